"""`jaxscale explain`: where every tensor of a layout lives, and what fills its memory.

    jaxscale explain --strategy dp=2,tp=2,pp=2,zero=3,micro_batches=2 --model tiny8
    jaxscale explain --strategy dp=8,zero=1 --strategy dp=2,tp=4 --json
    jaxscale explain --strategy dp=8,zero=3,precision=bf16 --model llama3-8b --target h100-8

Builds a layout's training state (never allocated: shapes and shardings) on forced
host-CPU devices, or on a target's compile-only chips, and prints, per tensor, its logical
axes, its PartitionSpec, one device's piece, its dtype and bytes, and how many devices hold
the same piece (jaxscale.compare.explain); then the per-device totals (their sum over
parameters, master weights and optimizer slots is the model state `compare` measures);
then what fills memory inside the step: the activations backward keeps per layer and the
compiled step's largest buffers at its peak (jaxscale.compare.explain_memory). With two
plans it prints what differs.
"""
from __future__ import annotations

import json

from jaxscale.cli.main import COMMANDS, _number


def register(subparsers) -> None:
    from jaxscale.cli.model_arg import FILE_HELP, model_arg
    from jaxscale.parallel.plan import LAYOUT_KEYS
    p = subparsers.add_parser(
        "explain", help=COMMANDS["explain"],
        description=(
            "Build a layout's training state (shapes and shardings, never allocated) and "
            "show, for every parameter, master weight, optimizer slot, counter and gradient: "
            "its logical axes, its PartitionSpec on the mesh, one device's piece (shape, "
            "dtype, bytes) and how many devices hold the same piece; the bytes per device by "
            "kind (parameters + master weights + optimizer slots = the model state `jaxscale "
            "compare` measures); then the activations backward keeps per layer (jax's trace "
            "of one block) and the compiled step's largest buffers at its peak (XLA's buffer "
            "assignment). Give --strategy twice to see what differs between two layouts; "
            "--target to compile for a TPU slice or NVIDIA GPUs from this machine."))
    p.add_argument("--strategy", action="append", required=True, metavar="LAYOUT",
                   help="a layout written out, e.g. dp=2,tp=2,pp=2,zero=3,micro_batches=2 "
                        f"(keys: {', '.join(LAYOUT_KEYS)}); once, or twice to compare two")
    p.add_argument("--model", default="tiny", type=model_arg, metavar="PRESET",
                   help=f"model preset; {FILE_HELP} (default tiny; with --target any preset)")
    p.add_argument("--devices", type=_number(), default=None, metavar="N",
                   help="forced host-CPU devices (default 8; with --target: its chips)")
    p.add_argument("--batch-size", type=_number(), default=32, metavar="B",
                   help="rows per step for the activations and the compiled step (default "
                        "32, compare's)")
    p.add_argument("--target", default=None, metavar="NAME",
                   help="compile for a target's compile-only chips, as `compare --abstract "
                        "--target` does: v5e-16, v6e-64, v5p-512, h100-8, h200-8, ...")
    p.add_argument("--seq", type=_number(), default=None, metavar="S",
                   help="with --target: tokens per sequence (default: the model's seq_len)")
    p.add_argument("--json", action="store_true", help="print one JSON object with every row")
    p.set_defaults(run=run)


def _checked(args):
    """(model config, plans, target or None), all checked before JAX starts."""
    import dataclasses

    from jaxscale.cli.commands.compare_target import check_target_sizes, checked_target
    from jaxscale.compare.strategies import CompareError, check_strategies
    from jaxscale.model import config as model_config
    from jaxscale.runtime import devices as devlib
    if len(args.strategy) > 2:
        raise CompareError(f"--strategy given {len(args.strategy)} times; give one layout to "
                           "explain, or two to compare")
    if args.seq and not args.target:
        raise CompareError("--seq sets a target job's sequence length: add --target")
    target = checked_target(args.target, args.devices) if args.target else None
    if target is not None:
        args.devices = target.n_devices
    else:
        model_config.check_platform(args.model, "cpu")
        args.devices = args.devices or 8
        devlib.check_cpu_count(args.devices)
    cfg = model_config.preset(args.model)
    cfg = dataclasses.replace(cfg, seq_len=args.seq) if args.seq else cfg
    checked = check_strategies([], args.devices, cfg, tuple(args.strategy))
    plans = [checked[s] for s in args.strategy]
    for s, plan in zip(args.strategy, plans):
        if args.batch_size % (plan.rows * plan.micro_batches):
            raise CompareError(f"--batch-size {args.batch_size} is not divisible by "
                               f"{'(dp x ep)' if plan.ep > 1 else 'dp'} x micro_batches = "
                               f"{plan.rows * plan.micro_batches} of {s}")
    if target is not None:
        check_target_sizes(dict(zip(args.strategy, plans)), target, args.strategy, cfg)
    return cfg, plans, target


def run(args) -> int:
    from jaxscale.cli.commands import explain_show as show
    cfg, plans, target = _checked(args)
    from jaxscale.runtime import devices as devlib, targets
    from jaxscale.runtime.compile_cache import enable_compilation_cache
    devices = (targets.target_devices(target) if target is not None
               else devlib.force_cpu_devices(args.devices))
    enable_compilation_cache()
    from jaxscale.compare import explain, explain_memory
    runs = []
    for s, plan in zip(args.strategy, plans):
        step, state = explain.build(cfg, plan, devices)
        rows = explain.tensors(cfg, plan, step, state)
        runs.append({"strategy": s, "plan": plan.as_dict(), "rows": rows,
                     "totals": explain.totals(rows), "inside": explain_memory.inside_step(
                         cfg, plan, step, state, devices, args.batch_size)})
    diff = explain.differences(runs[0]["rows"], runs[1]["rows"]) if len(runs) == 2 else None
    if args.json:
        print(json.dumps({"model": args.model, "devices": args.devices, "target": args.target,
                          "plans": runs, "differences": diff}))
        return 0
    if diff is None:
        show.tensors(runs[0])
        show.inside(runs[0])
    else:
        show.differences(runs, diff)
        show.inside_side_by_side(runs)
    show.totals(runs)
    return 0
