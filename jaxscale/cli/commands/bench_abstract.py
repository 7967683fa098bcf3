"""`jaxscale bench --abstract [--target NAME]`: every row compiled for one chip and never run
(jaxscale.bench.run_abstract): what the step needs of the chip's memory, and the floor
under its step time at the chip's datasheet peak. Without --target the chip is this
machine's first device."""
from __future__ import annotations

import json
import sys

from jaxscale.cli.main import UsageError


def run_abstract(args) -> int:
    from jaxscale import bench
    from jaxscale.cli.runtime_options import resolve_attention
    from jaxscale.runtime import devices as devlib

    if args.target and not args.abstract:
        raise UsageError("--target only compiles: add --abstract")
    if args.profile is not None:
        raise UsageError("--profile traces the timed steps, and --abstract runs none: drop one")
    target = _target(args.target) if args.target else None
    device = _device(target) if target else devlib.pick_devices(args.platform)[0]
    precision = args.precision or ("fp32" if device.platform == "cpu" else "bf16")
    # auto: the einsum reference (cuDNN's kernel needs the cuDNN library to lower)
    attention = ("einsum" if args.attention == "auto"
                 else resolve_attention(args.attention, device.platform, precision))
    configs = [bench.BenchConfig(args.model, batch, precision, remat, attention, args.unroll)
               for batch in (args.batch or [8]) for remat in args.remat]
    for c in configs:
        c.validate()
    hbm = target.hbm_bytes if target else None
    rows = []
    for i, c in enumerate(configs):
        print(f"[{i + 1}/{len(configs)}] batch {c.batch_size}, remat {c.remat}: compiling for "
              f"{target.name if target else device.device_kind} ...", file=sys.stderr, flush=True)
        rows.append(bench.run_abstract(c, device, hbm, target))
    result = {"model": args.model, "target": target and target.name,
              "device_kind": device.device_kind, "platform": device.platform,
              "hbm_bytes": hbm, "precision": precision, "attention": attention, "rows": rows}
    if args.json:
        print(json.dumps(result))
    else:
        _show(result)
    return 0  # a row the compiler refuses is a finding, as in compare --abstract


def _target(name: str):
    """The target NAME with its compiler installed (else one line: what to install)."""
    from jaxscale.runtime import targets
    try:
        target = targets.available_target(name)
    except targets.TargetError as e:
        raise UsageError(str(e)) from None
    return target


def _device(target):
    """One of the target's compile-only chips (libtpu's warnings kept back)."""
    from jaxscale.runtime import targets
    return targets.target_devices(target)[0]


def _show(result: dict) -> None:
    from jaxscale.costmodel.units import short_bytes
    from jaxscale.report import print_table
    rows = result["rows"]
    where = (f"one chip of {result['target']} ({result['device_kind']}, "
             f"{short_bytes(result['hbm_bytes'])} HBM)" if result["target"]
             else f"{result['device_kind']} ({result['platform']})")
    first = rows[0]
    peak = first["datasheet_peak"]
    print(f"{where}: compiled, not run; model FLOPs/token {first['flops_per_token']:,}; "
          + (f"datasheet peak {peak / 1e12:.4g} TFLOP/s ({first['compute_dtype']}), so at "
             f"100% MFU {first['tokens_per_s_at_peak']:,.0f} tokens/s" if peak
             else "no datasheet peak for this device"))
    fits = "fits" if result["hbm_bytes"] else "fits (no HBM given)"
    print_table(f"jaxscale bench --abstract: {result['model']}, {result['precision']}, "
                f"attention {result['attention']}",
                ["batch", "remat", "compile s", "needed / chip", fits, "step ms at peak",
                 "XLA/analytic FLOPs"],
                [[r["config"]["batch_size"], r["config"]["remat"], r["compile_s"],
                  short_bytes(r["needed_bytes"]) if r["needed_bytes"] else "-",
                  "-" if r["fits"] is None else ("yes" if r["fits"] else "NO"),
                  "-" if r["step_s_at_peak"] is None else r["step_s_at_peak"] * 1e3,
                  "-" if r["xla_flops_per_token"] is None
                  else r["xla_flops_per_token"] / r["flops_per_token"]] for r in rows])
    for r in rows:
        if r["refused"]:
            print(f"batch {r['config']['batch_size']}, remat {r['config']['remat']}: the "
                  f"compiler refused it: {r['refused']}", file=sys.stderr)
