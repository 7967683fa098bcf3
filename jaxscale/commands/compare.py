"""`jaxscale compare`: every parallel strategy side by side, measured next to predicted.

    jaxscale compare                                  # 8 CPU devices, tiny, 20 steps
    jaxscale compare --devices 4 --strategies single,dp,zero3,tp --json
    jaxscale compare --abstract --model 7b --devices 64   # compile only, XLA's memory

Each strategy trains on the same batches (same tokens per step) and is checked against the
single device; the table shows its memory, communication, compile and step time, each
measured figure beside the cost model's. Writes compare.json, compare.md and PNG charts.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from jaxscale.cli import _number

PLATFORMS = ("auto", "cpu", "gpu", "tpu")


def register(subparsers) -> None:
    from jaxscale.compare import STRATEGIES, TOLERANCE
    from jaxscale.model import PRESETS
    p = subparsers.add_parser(
        "compare", help="run every parallel strategy side by side, measured vs predicted",
        description=(
            "Train the same model with each parallel strategy on the same batches and show, "
            "per strategy: the loss against the single device (pass if every step is within "
            f"{TOLERANCE:g} relative), per-device memory of the compiled step (state shards "
            "and XLA's analysis) next to the closed forms, bytes each device sends per step "
            "by collective (read from the HLO) next to the cost model, compile time, median "
            "step time as a ratio to one device, and the pipeline's idle share. Strategies: "
            "single; dp; zero1/zero2/zero3 (over dp); tp (largest the heads allow); pp "
            "(largest the layers allow, 1F1B); dp+tp; dp+pp; 3d (dp x tp=2 x pp=2, ZeRO-1)."))
    p.add_argument("--devices", type=_number(), default=8, metavar="N",
                   help="devices to use (CPU: forced host devices; default 8)")
    p.add_argument("--platform", default="auto", choices=PLATFORMS, metavar="NAME",
                   help="cpu, gpu, tpu or auto (the default backend; default auto)")
    p.add_argument("--model", default="tiny", choices=list(PRESETS), metavar="PRESET",
                   help=f"model preset: {', '.join(PRESETS)} (default tiny)")
    p.add_argument("--steps", type=_number(), default=20, help="training steps (default 20)")
    p.add_argument("--batch-size", type=_number(), default=32,
                   help="documents per step, the same for every strategy (default 32)")
    p.add_argument("--strategies", default=None, metavar="LIST",
                   help=f"comma-separated, from {', '.join(STRATEGIES)} (default: all that "
                        "fit the devices)")
    p.add_argument("--abstract", action="store_true",
                   help="lower and compile only (no execution, no allocation): XLA's "
                        "per-device memory next to the formulas, for models too big to run")
    p.add_argument("--out", default="runs/compare", metavar="DIR",
                   help="folder for compare.json, compare.md and the PNGs (default runs/compare)")
    p.add_argument("--json", action="store_true", help="print one JSON object with every figure")
    p.set_defaults(run=run)


def _strategy_names(args, n, cfg):
    from jaxscale.compare import STRATEGIES, CompareError, strategy_plan
    if args.strategies is None:
        names = []
        for name in STRATEGIES:
            try:
                strategy_plan(name, n, cfg)
                names.append(name)
            except CompareError:
                pass  # does not fit these devices: left out of the default set
        return names
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    bad = [s for s in names if s not in STRATEGIES]
    if bad or not names:
        raise CompareError(f"unknown strategy {bad[0] if bad else args.strategies!r}; choose "
                           f"from {', '.join(STRATEGIES)}")
    if "single" not in names and not args.abstract:
        names.insert(0, "single")  # the reference every other strategy is checked against
    return names


def _devices(args):
    """The devices to use: forced host CPU devices (cpu, or auto when no accelerator is
    present), else the first --devices of the accelerator platform."""
    import jax

    from jaxscale.compare import CompareError
    from jaxscale.devices import force_cpu_devices
    if args.platform == "cpu":
        return force_cpu_devices(args.devices)
    if args.platform == "auto":
        jax.config.update("jax_num_cpu_devices", args.devices)  # used only if CPU is all
        if jax.default_backend() == "cpu":
            return force_cpu_devices(args.devices)
    try:
        found = jax.devices(None if args.platform == "auto" else args.platform)
    except RuntimeError as e:
        raise CompareError(f"no {args.platform} devices here ({e}); choose from "
                           f"{', '.join(PLATFORMS)}") from None
    if len(found) < args.devices:
        raise CompareError(f"--devices {args.devices}: only {len(found)} "
                           f"{found[0].platform} devices are present")
    return found[:args.devices]


def run(args) -> int:
    from jaxscale import model as modellib
    from jaxscale.compare import TOLERANCE, check_strategies
    cfg = modellib.preset(args.model)
    if not args.abstract and args.model not in modellib.CPU_PRESETS:
        from jaxscale.compare import CompareError
        raise CompareError(f"model {args.model!r} is too big to train here; use --abstract "
                           "to compile it without running, or one of "
                           f"{', '.join(modellib.CPU_PRESETS)}")
    names = _strategy_names(args, args.devices, cfg)
    plans = check_strategies(names, args.devices, cfg)  # every strategy valid before JAX starts
    for name, plan in plans.items():
        if args.batch_size % (plan.dp * plan.micro_batches):
            from jaxscale.compare import CompareError
            need = max(p.dp * p.micro_batches for p in plans.values())
            raise CompareError(f"strategy {name!r}: batch of {args.batch_size} documents is not "
                               f"divisible by dp x micro_batches = {plan.dp} x "
                               f"{plan.micro_batches}; try --batch-size {need}")
    devices = _devices(args)
    from jaxscale.cli import enable_compilation_cache
    enable_compilation_cache()
    from jaxscale.commands import compare_report as report
    if args.abstract:
        rows = report.run_abstract(cfg, plans, devices, args.batch_size)
        result = {"model": args.model, "devices": args.devices, "abstract": True, "rows": rows}
    else:
        rows = report.run_all(cfg, plans, devices, args.steps, args.batch_size)
        result = {"model": args.model, "devices": args.devices, "steps": args.steps,
                  "batch_size": args.batch_size, "tolerance": TOLERANCE, "rows": rows,
                  "all_pass": all(r["pass"] for r in rows)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(result, indent=1))
    markdown = report.markdown(result)
    (out / "compare.md").write_text(markdown)
    if not args.abstract:
        report.charts(result, out)
    if args.json:
        print(json.dumps(result))
    else:
        report.print_table(result)
        print(f"report, JSON and charts in {out}/", file=sys.stderr)
    return 0 if args.abstract or result["all_pass"] else 1
