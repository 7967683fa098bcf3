"""`jaxscale bench`: tokens/s, step time and MFU of one device's training step, next to a
matmul peak measured in the same run and the device's datasheet peak (jaxscale.bench)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jaxscale.cli.main import COMMANDS, EXIT_FAILED, _error, _number
from jaxscale.model import config as model_config


def _list(kind, name: str, choices=None):
    """argparse type: a comma-separated list of values (a sweep), each checked."""
    def parse(text: str):
        values = []
        for item in text.split(","):
            item = item.strip()
            if kind is int:
                values.append(_number()(item))
            elif item not in choices:
                raise argparse.ArgumentTypeError(f"unknown {name} {item!r} in {text!r}; "
                                                 f"choose from {', '.join(choices)}")
            else:
                values.append(item)
        if len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(f"{name} given twice in {text!r}")
        return values
    return parse


def register(subparsers) -> None:
    from jaxscale.cli import runtime_options as runtime
    from jaxscale.cli.calculator_args import preset_summary
    from jaxscale.cli.model_arg import FILE_HELP, model_arg
    from jaxscale.model.config import PRESETS
    from jaxscale.model.transformer import REMAT_POLICIES
    from jaxscale.model.precision import POLICIES

    b = subparsers.add_parser("bench", help=COMMANDS["bench"],
                              description=(
        "Time one device's training step (compile and warm-up excluded; the median of "
        "--steps) and report tokens/s and model FLOPs utilisation (MFU) against the "
        "device's datasheet peak and against a large matmul measured in the same run. "
        "--batch and --remat take comma-separated lists: every combination is timed."))
    b.add_argument("--model", default="tiny", type=model_arg, metavar="NAME",
                   help="; ".join(preset_summary(k) for k in PRESETS) + f"; {FILE_HELP} "
                        "(default tiny)")
    b.add_argument("--batch", type=_list(int, "batch"), default=None, metavar="B[,B...]",
                   help="rows per step (default 32 for tiny/tiny8/small, 8 otherwise)")
    b.add_argument("--precision", default=None, choices=list(POLICIES), metavar="POLICY",
                   help=f"{', '.join(POLICIES)} (default fp32 on CPU, bf16 on an accelerator)")
    b.add_argument("--remat", type=_list(str, "remat policy", list(REMAT_POLICIES)),
                   default=["none"], metavar="POLICY[,...]",
                   help=f"{', '.join(REMAT_POLICIES)} (default none)")
    b.add_argument("--steps", type=_number(), default=10, help="timed steps (default 10)")
    b.add_argument("--warmup", type=_number(minimum=0), default=2,
                   help="steps after the compile that are not timed (default 2)")
    b.add_argument("--json", action="store_true",
                   help="print one JSON object with every figure instead of a table")
    b.add_argument("--abstract", action="store_true",
                   help="compile each row without running it: the memory the step needs "
                        "per device (against the chip's HBM with --target) and its time at "
                        "the datasheet peak (100%% MFU); nothing is timed, so --steps and "
                        "--warmup do not apply (default batch 8)")
    b.add_argument("--target", default=None, metavar="NAME",
                   help="with --abstract: compile for one chip of a Cloud TPU slice or an "
                        "NVIDIA GPU from this machine (v5e-4, v5p-8, v6e-4, h100-1; "
                        "pip install -e \".[tpu]\" or \".[gpu]\"); precision bf16 unless "
                        "given")
    runtime.add_arguments(b)
    b.set_defaults(run=run)


def run(args) -> int:
    if args.abstract or args.target:
        from jaxscale.cli.commands.bench_abstract import run_abstract
        return run_abstract(args)
    import jax

    from jaxscale import bench
    from jaxscale.runtime import devices as devlib, profiling
    from jaxscale.measure import hardware
    from jaxscale.model import precision as precisionlib
    from jaxscale.runtime.compile_cache import enable_compilation_cache
    from jaxscale.cli.runtime_options import resolve_attention
    from jaxscale.report import print_table

    device = devlib.pick_devices(args.platform)[0]  # one device: the first
    model_config.check_platform(args.model, device.platform)
    precision = args.precision or ("fp32" if device.platform == "cpu" else "bf16")
    attention = resolve_attention(args.attention, device.platform, precision)
    small = args.model in model_config.CPU_PRESETS
    configs = [bench.BenchConfig(args.model, batch, precision, remat, attention, args.unroll,
                                 args.steps, args.warmup)
               for batch in (args.batch or [32 if small else 8]) for remat in args.remat]
    for c in configs:
        c.validate()
    if args.profile is not None:
        profiling.Profiler(args.profile)  # a bad folder fails now, before any compile
    enable_compilation_cache()
    say = (lambda msg: None) if args.json else (lambda msg: print(msg, file=sys.stderr))
    say(f"jaxscale bench: {device.device_kind} ({device.platform}); measuring a matmul peak")
    # the peak in the dtype the step computes in: a bf16 step against a bf16 matmul, an
    # fp32 one against fp32 (TF32 on an NVIDIA GPU, as XLA runs both by default)
    peak = hardware.measure_matmul_peak(device, precisionlib.policy(precision).compute_dtype)
    rows, failed = [], []
    for i, c in enumerate(configs):
        say(f"[{i + 1}/{len(configs)}] batch {c.batch_size}, remat {c.remat}: compiling, "
            f"then {c.warmup} + {c.steps} steps")
        where = None if args.profile is None else Path(args.profile) / _label(c)
        try:
            r = bench.run(c, device, peak, profiling.Profiler(where))
        except Exception as e:  # noqa: BLE001 - out of memory in one row must not end the sweep
            failed.append({"config": c.__dict__, "error": f"{type(e).__name__}: {e}"[:2000]})
            say(f"  failed: {failed[-1]['error'][:300]}")
            continue
        if where is not None:
            r.extra["profile"] = str(where)
            r.extra["top_ops"] = [op.__dict__ for op in profiling.top_ops(where) or []]
        rows.append(r)
    first = rows[0] if rows else None
    result = {"device_kind": device.device_kind, "platform": device.platform,
              "matmul_peak": peak.as_dict(),
              "datasheet_peak": first and first.datasheet_peak,
              "convention": first and first.flops.convention,
              "rows": [r.to_json() for r in rows], "failed": failed, "jax": jax.__version__,
              "fp8": _fp8_note(precision, device.platform)}
    if args.json:
        print(json.dumps(result))
        return EXIT_FAILED if failed else 0
    for f in failed:
        _error(f"batch {f['config']['batch_size']}, remat {f['config']['remat']}: "
               f"{f['error'][:500]}")
    if not rows:
        return EXIT_FAILED
    f = rows[0].flops
    _header(device, peak, result, rows[0], precision)
    print_table(f"jaxscale bench: {args.model}, {precision}, attention {attention}, layers "
                f"{'unrolled' if args.unroll else 'scanned'}",
                ["batch", "remat", "compile s", "step ms", "tokens/s", "TFLOP/s",
                 "MFU datasheet", "MFU matmul", "XLA/analytic FLOPs", "memory GiB"],
                [[r.config.batch_size, r.config.remat, r.compile_s, r.step_s * 1e3,
                  r.tokens_per_s, r.achieved_flops_per_s / 1e12, _pct(r.mfu_datasheet),
                  _pct(r.mfu_matmul),
                  "-" if r.xla_flops_per_token is None else r.xla_flops_per_token / f.total,
                  _step_bytes(r.memory) / 2 ** 30]
                 for r in rows])
    for r in rows:
        if r.extra.get("top_ops"):
            ops = ", ".join(f"{o['name']} {o['share']:.0%}" for o in r.extra["top_ops"])
            print(f"top ops, batch {r.config.batch_size} remat {r.config.remat}: {ops} "
                  f"(trace in {r.extra['profile']})")
    return 0


def _step_bytes(m: dict) -> int:
    """A step's bytes per device: its arguments (the state, the batch) and temporaries,
    less what the outputs reuse of the arguments (the donated state)."""
    return m["arguments"] + m["outputs"] + m["temporaries"] - m["aliased"]


def _label(c) -> str:
    return f"b{c.batch_size}-{c.remat}"


def _pct(x):
    return "-" if x is None else f"{x:.1%}"


def _fp8_note(precision: str, platform: str) -> str | None:
    """What an fp8 row measures here: on a CPU the casts are computed and the products are
    fp32 (an emulation: no speed figure for FP8); elsewhere XLA may use FP8 GEMMs; MFU is
    against the bf16 peak either way."""
    if not precision.startswith("fp8"):
        return None
    if platform == "cpu" or precision == "fp8-block":
        return (f"emulated on the {platform.upper()}: the FP8 casts are computed, the products "
                "are fp32 (numerics, not speed); MFU against the bf16 peak")
    return ("the products in FP8 where XLA rewrites them into FP8 GEMMs, fp32 where it does "
            "not; MFU against the bf16 peak (FP8's datasheet peak is twice it)")


def _header(device, peak, result, first, precision) -> None:
    """The lines above the table: the peaks the MFU columns divide by, the FLOP count."""
    f = first.flops
    print(f"{device.device_kind}: matmul peak {peak.flops_per_s / 1e12:.3g} TFLOP/s measured "
          f"({peak.dtype}, n={peak.n}); datasheet "
          + (f"{result['datasheet_peak'] / 1e12:.4g} TFLOP/s ({first.compute_dtype})"
             if result["datasheet_peak"] else "peak unknown for this device"))
    print(f"model FLOPs/token {f.total:,} ({f.total_causal:,} causal): {f.convention}")
    if result["fp8"]:
        print(f"{precision}: {result['fp8']}")
