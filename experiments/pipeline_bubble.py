"""Lecture 13 §4.3 extended to the zero-bubble schedules (Qi et al. 2023): the bubble against
the micro-batches for six schedules, simulated and executed, with the activations each holds.

    python -m experiments.pipeline_bubble [--out runs/pipeline_bubble] [--parts ab] [--json]

Runs on 8 host-CPU devices (forced here, before JAX starts), on the tiny8 preset (8 layers).

a. simulated: the idle fraction of GPipe, 1F1B, interleaved 1F1B (v = 2), ZB-H1, ZB-H2 and
   ZB-V against m at p = 4 and 8 (F = B = W: a backward is twice a forward, split equally),
   each next to its closed form, and the activations the first stage holds at its peak (in
   stages' worth); one chart of both (bubble.png)
b. executed: one training step of each schedule on tiny8 at p = 4, m = 8 (and the one-chunk
   schedules at p = 8, m = 16), against the single device: the largest relative gradient
   difference and the loss's, the idle share of the tick table the executor runs, and XLA's
   temporary bytes per device (what holds the activations, among others)

The executed idle share is a count over the executor's lockstep ticks, not a wall-clock
measurement: 8 forced devices share this machine's 2 cores, so their time shows no bubble.
"""
from __future__ import annotations

import sys
from pathlib import Path

from jaxscale.runtime.devices import force_cpu_devices

N_DEVICES = 8
if __name__ == "__main__":
    force_cpu_devices(N_DEVICES)

import jax  # noqa: E402
import optax  # noqa: E402

from experiments._runner import run_experiment  # noqa: E402
from jaxscale import costmodel as cm, garden  # noqa: E402
from jaxscale.costmodel.schedule import least_micro_batches  # noqa: E402
from jaxscale.measure import compare_trees, memory  # noqa: E402
from jaxscale.model import config as model_config  # noqa: E402
from jaxscale.parallel import schedules as sched  # noqa: E402
from jaxscale.parallel.build import build_train_step  # noqa: E402
from jaxscale.parallel.plan import Plan  # noqa: E402
from jaxscale.parallel.tick_table import tick_table  # noqa: E402
from jaxscale.report import print_table, pyplot, save_figure  # noqa: E402
from jaxscale.training.config import TrainConfig  # noqa: E402
from jaxscale.training.reference import as_arrays, init_run  # noqa: E402

MODEL, BATCH = "tiny8", 32
# (schedule, chunks per device) in the order of the chart's legend
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-h2", 1),
             ("zbv", 2))
KEEP_GRADIENT = optax.chain(optax.trace(decay=0.0), optax.scale(0.0))  # the state: g


class Lab:
    def __init__(self, seed: int = 0):
        if len(jax.devices()) != N_DEVICES:
            raise SystemExit(f"needs {N_DEVICES} devices, JAX has {len(jax.devices())}: run it "
                             "as python -m experiments.pipeline_bubble")
        self.cfg = model_config.preset(MODEL)
        _, self.params, _ = init_run(TrainConfig(model=MODEL, seed=seed))
        self.batch = as_arrays(next(garden.make_corpus(seed).train_batches(BATCH, seed=seed)))

    def one_step(self, plan: Plan) -> dict:
        """The whole gradient and loss of one step of `plan`, and XLA's memory figures."""
        init, step = build_train_step(self.cfg, plan, KEEP_GRADIENT,
                                      jax.devices()[:plan.n_devices])
        state0, batch = init(self.params), step.place_batch(self.batch)
        compiled = step.jitted.lower(state0, batch).compile()
        state, metrics = compiled(state0, batch)
        grad = step.full_params(state._replace(params=state.opt_state[0].trace))
        return {"grad": jax.device_get(grad), "loss": float(metrics["loss"]),
                "memory": memory.memory(compiled)}


def part_a(lab: Lab, out: Path) -> dict:
    res, rows = {}, []
    for p in (4, 8):
        for name, v in SCHEDULES:
            least = p if name == "interleaved" else least_micro_batches(name, p)
            ms = [m for m in range(least, 4 * p + 1) if name != "interleaved" or m % p == 0]
            curve = []
            for m in ms:
                tl = sched.run(name, p, m, v)
                formula = sched.bubble_over_total(name, p, m, v)
                curve.append({"m": m, "idle": float(tl.idle_fraction),
                              "formula": float(formula), "equal": tl.idle_fraction == formula,
                              "cost_model": cm.bubble_over_total(p, m, v, schedule=name),
                              "peak_stages": max(tl.peak_in_flight) / v})
            res[f"{name} p={p}"] = curve
            at = next(c for c in curve if c["m"] == 2 * p)
            rows.append([name, p, v, f"{at['idle']:.4f}", f"{at['formula']:.4f}",
                         "yes" if all(c["equal"] for c in curve) else "NO",
                         f"{at['peak_stages']:g}"])
    print_table("a. idle fraction at m = 2p (simulated; formula; equal over every m up to 4p) "
                "and the first stage's peak activations, in stages' worth",
                ["schedule", "p", "v", "idle at m = 2p", "formula", "equal for all m",
                 "peak activations"], rows)
    _chart(res, out / "bubble.png")
    return {"curves": res}


def _chart(res: dict, path: Path) -> None:
    plt = pyplot()
    fig, (idle, held) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (name, v) in enumerate(SCHEDULES):
        for p, style in ((4, "-"), (8, "--")):
            curve = res[f"{name} p={p}"]
            idle.plot([c["m"] for c in curve], [c["idle"] for c in curve], style, color=f"C{i}",
                      marker=".", label=f"{name} p={p}")
        held.bar([i - 0.2, i + 0.2], [res[f"{name} p={p}"][-1]["peak_stages"] for p in (4, 8)],
                 width=0.4, color=f"C{i}", edgecolor="black", hatch=None)
    idle.set(xlabel="micro-batches m", ylabel="idle fraction (simulated)", xscale="log",
             title="the bubble against m (solid p = 4, dashed p = 8)\n"
                   "GPipe's curve lies under 1F1B's, ZB-H2's under ZB-H1's")
    idle.legend(fontsize=7, ncol=2)
    held.set_xticks(range(len(SCHEDULES)), [n for n, _ in SCHEDULES])
    held.set(ylabel="activations held at the peak (stages' worth)",
             title="first stage's peak, m = 4p (left bar p = 4, right p = 8)")
    save_figure(fig, path)


def part_b(lab: Lab, out: Path) -> dict:
    ref = lab.one_step(Plan())
    runs = [(name, 4, 8, v) for name, v in SCHEDULES] + [
        (name, 8, 16, 1) for name in ("1f1b", "zb-h1", "zb-h2")]
    res, rows = [], []
    for name, p, m, v in runs:
        run = lab.one_step(Plan(pp=p, micro_batches=m, schedule=name, virtual=v))
        table = tick_table(name, p, m, v)
        r = {"schedule": name, "p": p, "m": m, "v": v,
             "max_rel_grad_diff": compare_trees.max_rel_diff(run["grad"], ref["grad"]),
             "loss_rel_diff": abs(run["loss"] - ref["loss"]) / ref["loss"],
             "idle_executed": table.branch_share()[0],
             "idle_simulated": float(sched.run(name, p, m, v).idle_fraction),
             "temporaries": run["memory"]["temporaries"]}
        res.append(r)
        rows.append([name, p, m, v, f"{r['max_rel_grad_diff']:.1e}", f"{r['loss_rel_diff']:.1e}",
                     f"{r['idle_executed']:.4f}", f"{r['idle_simulated']:.4f}",
                     f"{r['temporaries']:,}"])
    print_table("b. one step of each schedule on tiny8 against one device",
                ["schedule", "p", "m", "v", "max rel grad diff", "loss diff", "idle (executed)",
                 "idle (simulated)", "XLA temporaries, bytes"], rows)
    return {"runs": res}


PARTS = {"a": part_a, "b": part_b}
TITLES = {"a": "the bubble against m, six schedules (simulated)",
          "b": "each schedule executed against one device"}


def main(argv=None) -> int:
    return run_experiment("pipeline_bubble", __doc__, PARTS, TITLES, Lab, argv)


if __name__ == "__main__":
    sys.exit(main())
