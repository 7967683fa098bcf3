"""`plan --verify N --target NAME`: the planner's top N layouts compiled for a Cloud TPU slice
by XLA:TPU from this machine (jaxscale.compare.verify), and ranked again by what the
compiler says fits."""
from __future__ import annotations

import sys

from jaxscale import costmodel as cm
from jaxscale.cli.calculator_args import table
from jaxscale.costmodel import devices as D
from jaxscale.costmodel.units import human_bytes, short_bytes


def checked_target(args):
    """--target and --verify, checked before any work: the Target (or None); --devices and
    --device default to the target's chips, and a different value is refused."""
    if args.verify is None and args.target is None:
        return None
    from jaxscale.runtime import targets
    if args.verify is None or args.target is None or not args.model:
        raise cm.CostModelError("--verify N needs --target NAME and --model (a preset or a "
                                "config.json): it compiles the model for the target")
    try:
        target = targets.available_target(args.target)
    except targets.TargetError as e:
        raise cm.CostModelError(str(e)) from None
    if args.devices not in (None, target.n_devices):
        raise cm.CostModelError(f"--devices {args.devices}, but {target.name} has "
                                f"{target.n_devices} chips")
    chip = f"tpu-{target.generation}"
    if args.device not in (None, chip):
        raise cm.CostModelError(f"--device {args.device}, but {target.name}'s chips are "
                                f"{chip}: drop --device (it follows --target)")
    if chip not in D.DEVICES:
        raise cm.CostModelError(f"the cost model has no {chip} to plan with")
    args.devices, args.device = target.n_devices, chip
    args.top = max(args.top, args.verify - 1)
    return target


def verify(args, out: dict, target) -> dict:
    from dataclasses import replace as with_

    from jaxscale.compare.verify import verify
    from jaxscale.model.config import preset
    from jaxscale.runtime import targets
    cfg = preset(args.model)
    cfg = with_(cfg, seq_len=out["job"]["shape"]["seq"])
    candidates = ([out["recommended"]] if out["recommended"] else []) + out["alternatives"]
    return verify(cfg, candidates[:args.verify], target, targets.target_devices(target),
                  args.batch, args.bytes_per_param)


def render(v: dict) -> None:
    table(f"the planner's top {len(v['rows'])} compiled for {v['target']} by XLA:TPU "
          f"(memory per chip; the chip has {human_bytes(v['hbm_bytes'])})",
          ["planner rank", "layout", "planner's memory", "compiler's", "planner's error",
           "fits", "new rank"],
          [[r["rank"], r["name"], short_bytes(r["predicted_bytes"]),
            short_bytes(r["compiled_bytes"]) if r.get("compiled_bytes") else "-",
            f"{r['error']:+.1%}" if r.get("error") is not None else "-",
            "yes" if r["fits"] else ("not buildable" if not r["buildable"] else "NO"),
            v["reranked"].index(r["rank"]) + 1] for r in v["rows"]])
    for r in v["rows"]:
        if r.get("refused") or not r["buildable"]:
            print(f"{r['name']}: {r.get('refused') or r['why']}", file=sys.stderr)
