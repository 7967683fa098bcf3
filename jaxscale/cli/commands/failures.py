"""`jaxscale failures`: how often a cluster fails and how often to checkpoint.

    jaxscale failures --devices 1024 --mtbf-hours 50000 --save-minutes 10
    jaxscale failures --devices 16384 --restart-minutes 15 --async-blocking-minutes 0.5

Cluster MTBF = device MTBF / N; Young's interval sqrt(2 delta M) and its wasted fraction
sqrt(2 delta / M); Daly's higher-order interval and the exact waste under exponential
failures; an asynchronous checkpoint that stops training only for a snapshot. The formulas
and their derivation are in jaxscale.costmodel.failures.
"""
from __future__ import annotations

from jaxscale.costmodel import failures as F
from jaxscale.cli.calculator_args import emit, size_arg, table
from jaxscale.cli.main import COMMANDS


def register(subparsers) -> None:
    from jaxscale.cli.main import _number

    p = subparsers.add_parser("failures", help=COMMANDS["failures"], description=(
        "Failures and checkpoints of a training job on N devices, from closed forms. Any "
        "device failing stops the job, so the cluster MTBF is M = device MTBF / N. Saving a "
        "checkpoint takes delta; saving every tau of work wastes about delta/tau + (tau/2 + "
        "R)/M (R: restart), least at Young's tau* = sqrt(2 delta M), where it is sqrt(2 "
        "delta/M) + R/M. Daly's refinement corrects tau* when delta is not << M and gives the "
        "exact waste under exponential failures. An asynchronous checkpoint stops training "
        "only for a snapshot (--async-blocking-minutes) and writes in the background "
        "(--async-write-minutes), during which the previous checkpoint is the one to restart "
        "from."))
    p.add_argument("--devices", type=size_arg(), default=1024, metavar="N",
                   help="devices in the job (default 1024)")
    p.add_argument("--mtbf-hours", type=_number(float, 0, exclusive=True), default=50000.0,
                   metavar="H", help="mean time between failures of one device, hours "
                                     "(default 50000)")
    p.add_argument("--save-minutes", type=_number(float, 0, exclusive=True), default=10.0,
                   metavar="MIN", help="time training stops to save one checkpoint (default 10)")
    p.add_argument("--restart-minutes", type=_number(float, 0), default=0.0, metavar="MIN",
                   help="time to restart after a failure: replace the node, reload (default 0)")
    p.add_argument("--async-blocking-minutes", type=_number(float, 0, exclusive=True),
                   default=None, metavar="MIN",
                   help="asynchronous checkpoint: time training stops for the snapshot "
                        "(default save/10, as in lecture 13 exercise 9)")
    p.add_argument("--async-write-minutes", type=_number(float, 0), default=None, metavar="MIN",
                   help="asynchronous checkpoint: background write time (default the save time)")
    p.add_argument("--json", action="store_true", help="print one JSON object with every figure")
    p.set_defaults(run=run)


def compute(args) -> dict:
    """Every figure, times in minutes (and the MTBFs in hours too)."""
    r = F.checkpoint_plan(args.devices, args.mtbf_hours * 60, args.save_minutes,
                          args.restart_minutes, args.async_blocking_minutes,
                          args.async_write_minutes)
    r["unit"] = "minutes"
    r["device_mtbf_hours"] = args.mtbf_hours
    r["cluster_mtbf_hours"] = r["cluster_mtbf"] / 60
    return r


def _pct(x: float) -> str:
    if x > 1:  # the first-order formula counts losses twice once failures come that often
        return f"{100 * x:,.4g}% (over 100%: the first order no longer holds)"
    return f"{100 * x:.2f}%"


def render(r: dict) -> None:
    from jaxscale.report import plural

    y, d, a = r["young"], r["daly"], r["async"]
    table(f"{plural(r['devices'], 'device')}, each failing every "
          f"{plural(r['device_mtbf_hours'], 'hour')} on average; save {r['save']:g} min, "
          f"restart {r['restart']:g} min",
          ["", "value"],
          [["cluster MTBF M = device MTBF / N",
            f"{r['cluster_mtbf_hours']:,.4g} h ({r['cluster_mtbf']:,.5g} min)"],
           ["Young: tau* = sqrt(2 delta M)", f"{y['interval']:,.4g} min"],
           ["  wasted, first order: delta/tau + (tau/2 + R)/M", _pct(y["waste_first_order"])],
           ["  wasted, exact (exponential failures)", _pct(y["waste_exact"])],
           ["Daly: higher-order tau*", f"{d['interval']:,.4g} min"],
           ["  wasted, exact", _pct(d["waste_exact"])],
           [f"async: tau* = sqrt(2 x {a['blocking']:g} x M)", f"{a['interval']:,.4g} min"],
           ["  wasted, background write ignored (exercise 9)", _pct(a["waste_write_ignored"])],
           [f"  wasted, restart from the previous save during the {a['write']:g} min write",
            _pct(a["waste_with_write"])]])
    if a["blocking"] >= r["save"]:
        print(f"note: the async snapshot blocks training {a['blocking']:g} min, no less than "
              f"the {r['save']:g} min synchronous save: asynchronous saving cannot win here "
              "(it is worth having when the snapshot to host memory is much shorter than "
              "the write)")
    if not a["interval_covers_write"]:
        print(f"note: the async interval {a['interval']:.3g} min is shorter than the "
              f"{a['write']:g} min write: saves would queue up")
    if d["waste_exact"] > 0.5:
        print(f"note: the job fails every {r['cluster_mtbf']:,.3g} min on average, against a "
              f"{r['save']:g} min save: more than half the time is lost at any interval; use "
              "fewer or more reliable devices, or faster (asynchronous) saves")


def run(args) -> int:
    return emit(args, compute(args), render)
