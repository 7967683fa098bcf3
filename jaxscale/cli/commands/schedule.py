"""`jaxscale schedule`: simulate a pipeline schedule, draw it and count its bubble.

    jaxscale schedule --stages 4 --micro-batches 4 --schedule gpipe
    jaxscale schedule --stages 4 --micro-batches 8 --schedule interleaved --virtual 2 --json

Pure Python (jaxscale.parallel.schedules, .gantt); JAX is never started. The sizes are
bounded (MAX_* below) so that any run within them finishes in seconds: the simulator steps
through every forward and backward, 2 x p x m x v of them, in Python.
"""
from __future__ import annotations

import json
from fractions import Fraction

from jaxscale.cli.main import COMMANDS, _number
from jaxscale.parallel import schedules as sched
from jaxscale.parallel.gantt import gantt_png
from jaxscale.cli.paths import output_file
from jaxscale.report import figure_formats, plural

# Each option's bound, and one on their product: p x m x v forwards (and as many backwards)
# to simulate. 64 stages, 1,024 micro-batches and 16 chunks each are beyond common practice;
# at the product bound the simulation (~10 us per action) and the text chart take under a
# second and the PNG of 16,384 boxes one to two more (measured on a loaded 2-core CPU).
MAX_STAGES, MAX_MICRO_BATCHES, MAX_VIRTUAL = 64, 1024, 16
MAX_FORWARDS = 8192


def register(subparsers) -> None:
    """Add the `schedule` subcommand to jaxscale's parser."""
    p = subparsers.add_parser(
        "schedule", help=COMMANDS["schedule"],
        description=(
            "Simulate one training step of a pipeline (forwards and backwards of every "
            "micro-batch on every stage, each action waiting for its inputs), print it as a "
            "chart, and report the simulated idle fraction next to the textbook formula and "
            "the activations each device holds at its peak."))
    p.add_argument("--stages", type=_number(maximum=MAX_STAGES), default=4, metavar="P",
                   help=f"pipeline stages p, one per device (default 4, at most {MAX_STAGES})")
    p.add_argument("--micro-batches", type=_number(maximum=MAX_MICRO_BATCHES), default=4,
                   metavar="M", help="micro-batches m per step (default 4, at most "
                                     f"{MAX_MICRO_BATCHES:,})")
    p.add_argument("--schedule", default="1f1b", metavar="NAME",
                   help=f"one of {', '.join(sched.SCHEDULES)} (default 1f1b)")
    p.add_argument("--virtual", type=_number(maximum=MAX_VIRTUAL), default=None, metavar="V",
                   help="model chunks per device, interleaved only (default 2 there and for "
                        f"zbv, else 1; at most {MAX_VIRTUAL}); p x m x v at most "
                        f"{MAX_FORWARDS:,}")
    p.add_argument("--forward-cost", type=_number(float, 0, exclusive=True), default=1.0,
                   metavar="T", help="time of one stage's forward (default 1)")
    p.add_argument("--backward-cost", type=_number(float, 0, exclusive=True), default=2.0,
                   metavar="T", help="time of one stage's backward (default 2)")
    p.add_argument("--weight-cost", type=_number(float, 0, exclusive=True), default=None,
                   metavar="T", help="zero-bubble schedules (zb-h1, zb-h2, zbv) split the backward "
                   "into the input gradient (B) and the weight gradient (W): W's time, less "
                   "than the backward's (default half of it); B takes the rest")
    p.add_argument("--png", type=_figure_file, default=None, metavar="FILE",
                   help="also write a Gantt chart to FILE (its folder must exist; .png, or "
                        "another format matplotlib writes: .svg, .pdf, ...)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object with every figure instead of the chart")
    p.set_defaults(run=_cmd_schedule)


def _figure_file(text: str):
    """argparse type: an output file in a format matplotlib writes (matplotlib is imported
    only when --png is given)."""
    return output_file(text, figure_formats())


def _show(x: Fraction) -> str:
    return str(x) if x.denominator == 1 else f"{x} = {float(x):.4f}"


def _cmd_schedule(args) -> int:
    name, p, m = args.schedule, args.stages, args.micro_batches
    if name not in sched.SCHEDULES:  # named as unknown before any check that takes it as known
        sched.check_sizes(name, p, m)  # raises ScheduleError: unknown, and the choices
    v = args.virtual if args.virtual is not None else (
        2 if name in ("interleaved", *sched.VEE) else 1)
    if v > 1 and name in sched.SCHEDULES and name not in ("interleaved", *sched.VEE):
        raise sched.ScheduleError(f"--virtual {v} needs --schedule interleaved; {name} runs "
                                  "one model chunk per device")
    if p * m * v > MAX_FORWARDS:
        raise sched.ScheduleError(
            f"--stages {p} x --micro-batches {m} x --virtual {v} = {p * m * v:,} forwards to "
            f"simulate, more than {MAX_FORWARDS:,} (a chart of {2 * p * m * v:,} boxes); "
            "lower one of them")
    if args.weight_cost is not None and name not in sched.SPLIT:
        raise sched.ScheduleError(f"--weight-cost is for the schedules that split the backward "
                                  f"({', '.join(sched.SPLIT)}); {name} runs it whole")
    costs = (args.forward_cost, args.backward_cost, args.weight_cost)
    orders = sched.stage_orders(name, p, m, v)
    tl = sched.simulate(orders, p, m, v, *costs, vee=name in sched.VEE)
    formula_text = ("idle/(idle+m(F+B+W)), idle = (p-1) max(F, F+B-" + "2" * (name == "zb-h2")
                    + "W)" if name in ("zb-h1", "zb-h2") else
                    "idle/(idle+2m(F+B+W)), F, B, W a chunk's, idle = (p-1) F, for F = B = W"
                    if name
                    in sched.VEE else "(p-1)/(v*m+p-1)" if v > 1 else "(p-1)/(m+p-1)")
    formula, simulated = sched.bubble_over_total(name, p, m, v, *costs), tl.idle_fraction
    chart = sched.text_chart(tl)
    png = None if args.png is None else str(args.png)
    if png:
        gantt_png(tl, png, title=f"{name}, p={p}, m={m}, v={v}: idle {float(simulated):.1%}"
                                 " (simulated)" + ("" if formula is None else
                                 f", formula {formula_text} = {float(formula):.1%}"))
    if args.json:
        print(json.dumps({
            "schedule": name, "stages": p, "micro_batches": m, "virtual": v,
            "forward_cost": args.forward_cost, "backward_cost": args.backward_cost,
            "weight_cost": (float(sched.action_costs(*costs, split=True)["W"])
                            if tl.split else None),
            "makespan": float(tl.makespan), "busy": [float(b) for b in tl.busy],
            "idle_fraction": float(simulated), "idle_fraction_exact": str(simulated),
            "formula": formula_text,
            "formula_idle_fraction": None if formula is None else float(formula),
            "formula_idle_fraction_exact": None if formula is None else str(formula),
            "matches_formula": None if formula is None else simulated == formula,
            "peak_in_flight": tl.peak_in_flight,
            "orders": [[a.label(v) for a in order] for order in orders],
            "timeline": [[{"start": float(s), "end": float(e), "kind": a.kind,
                           "micro_batch": a.micro_batch, "chunk": a.chunk} for s, e, a in row]
                         for row in tl.rows],
            "chart": chart, "png": png}))
        return 0
    what = "micro-batches" if v == 1 else f"chunk activations (each 1/{v} of a device's layers)"
    example = f"; F{m - 1}b = micro-batch {m - 1} on chunk b" if v > 1 else ""
    split = ("" if not tl.split else " = input gradient B {:g} + weight gradient W {:g}".format(
        *(float(c) for k, c in sched.action_costs(*costs, split=True).items() if k != "F")))
    print(f"{name}: p = {plural(p, 'stage')}, m = {plural(m, 'micro-batch')}, v = "
          f"{plural(v, 'chunk')} per device; forward {args.forward_cost:g}, backward "
          f"{args.backward_cost:g}{split} per stage{example}")
    print(chart)
    print(f"makespan {_show(tl.makespan)}, busy {_show(tl.busy[0])} per device")
    print(f"idle fraction: simulated {_show(simulated)}; formula {formula_text}"
          + (" (none for these costs)" if formula is None else f" = {_show(formula)} "
             f"({'equal' if simulated == formula else 'DIFFERENT'})"))
    print(f"peak in-flight {what} per device: {' '.join(map(str, tl.peak_in_flight))}"
          + (f" (GPipe would hold {'all ' * (m > 1)}{plural(m, 'micro-batch')} on every "
             "device)" if name == "1f1b" else " (held from F until W)" if tl.split else ""))
    if png:
        print(f"Gantt chart in {png}")
    return 0
