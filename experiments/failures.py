"""Lecture 13 §6 and exercise 9: hardware failures at scale and the checkpoint interval.

    python -m experiments.failures [--out runs/failures] [--parts abcd] [--json]

a. cluster MTBF = device MTBF / N for 8, 1024 and 16384 devices (50,000 h per device)
b. Young's optimal interval sqrt(2 delta M) and its waste sqrt(2 delta / M), checked against
   a numerical minimum of the first-order waste; Daly's refinement and the exact waste
   under exponential failures; waste against interval as a figure
c. exercise 9: an asynchronous checkpoint that stops training for delta/10; also counting
   the background write, during which only the previous checkpoint can be restarted from
d. delta measured on this machine: a real checkpoint of the tiny model's state after one
   AdamW step (single device, jaxscale.checkpoint, after a warm-up save), synchronous and
   asynchronous, and Young's interval on 1024 devices with it, next to the lecture's 10 min

Everything printed is computed here with jaxscale.failures; only the inputs (50,000 h,
10 minutes, the device counts) come from the lecture, and part d's delta is measured.
"""
from __future__ import annotations

import sys
from pathlib import Path

from experiments._runner import run_experiment
from jaxscale import failures as F
from jaxscale.report import print_table, pyplot, save_figure

DEVICE_MTBF_H = 50_000
SAVE_MIN = 10.0
COUNTS = (8, 1024, 16384)


def _mtbf_min(n: int) -> float:
    return F.cluster_mtbf(DEVICE_MTBF_H, n) * 60


def part_a(lab, out: Path) -> dict:
    rows = [{"devices": n, "cluster_mtbf_hours": F.cluster_mtbf(DEVICE_MTBF_H, n),
             "cluster_mtbf_minutes": _mtbf_min(n)} for n in COUNTS]
    print_table(f"a. cluster MTBF = {DEVICE_MTBF_H:,} h / N", ["devices", "hours", "minutes"],
                [[r["devices"], r["cluster_mtbf_hours"], r["cluster_mtbf_minutes"]] for r in rows])
    return {"device_mtbf_hours": DEVICE_MTBF_H, "rows": rows}


def _argmin(f, lo: float, hi: float, steps: int = 20000) -> float:
    """The grid point (geometric, lo..hi) where f is least: a check on the calculus."""
    xs = [lo * (hi / lo) ** (i / steps) for i in range(steps + 1)]
    return min(xs, key=f)


def part_b(lab, out: Path) -> dict:
    rows = []
    for n in COUNTS:
        m = _mtbf_min(n)
        young = F.young_interval(SAVE_MIN, m)
        numeric = _argmin(lambda t, m=m: F.first_order_waste(t, SAVE_MIN, m), 1.0, 10 * m)
        exact_best = _argmin(lambda t, m=m: F.expected_waste(t, SAVE_MIN, m), 1.0, 10 * m)
        daly = F.daly_interval(SAVE_MIN, m)
        rows.append({"devices": n, "mtbf_minutes": m, "young_interval": young,
                     "numeric_argmin_first_order": numeric,
                     "young_waste": F.first_order_waste(young, SAVE_MIN, m),
                     "sqrt_2delta_over_M": (2 * SAVE_MIN / m) ** 0.5,
                     "daly_interval": daly, "numeric_argmin_exact": exact_best,
                     "exact_waste_young": F.expected_waste(young, SAVE_MIN, m),
                     "exact_waste_daly": F.expected_waste(daly, SAVE_MIN, m)})
    print_table(f"b. checkpoint every tau minutes, {SAVE_MIN:g} min per save: Young's tau* = "
                "sqrt(2 delta M) next to the numerical minimum of delta/tau + tau/(2M); Daly's "
                "tau* next to the exact model's minimum",
                ["devices", "M (min)", "Young tau*", "numerical", "waste sqrt(2 delta/M)",
                 "Daly tau*", "exact model's best", "exact waste at Young", "at Daly"],
                [[r["devices"], r["mtbf_minutes"], r["young_interval"],
                  r["numeric_argmin_first_order"], f"{100 * r['young_waste']:.2f}%",
                  r["daly_interval"], r["numeric_argmin_exact"],
                  f"{100 * r['exact_waste_young']:.2f}%", f"{100 * r['exact_waste_daly']:.2f}%"]
                 for r in rows])
    m = _mtbf_min(1024)
    taus = [10 * 1.05**i for i in range(110)]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(taus, [100 * F.first_order_waste(t, SAVE_MIN, m) for t in taus],
            label="first order: delta/tau + tau/(2M)")
    ax.plot(taus, [100 * F.expected_waste(t, SAVE_MIN, m) for t in taus],
            label="exact, exponential failures")
    ax.axvline(F.young_interval(SAVE_MIN, m), color="k", ls="--", lw=0.8,
               label=f"Young's tau* = sqrt(2 delta M) = {F.young_interval(SAVE_MIN, m):.0f} min")
    ax.set(xscale="log", xlabel="minutes of work between checkpoints, tau (log)",
           ylabel="time wasted (%)", ylim=(0, 40),
           title=f"1024 devices (M = {m:.0f} min), {SAVE_MIN:g} min per checkpoint")
    ax.legend(fontsize=8, loc="lower left")
    save_figure(fig, out / "b_waste_vs_interval.png")
    return {"save_minutes": SAVE_MIN, "rows": rows}


def part_c(lab, out: Path) -> dict:
    rows = []
    for n in COUNTS[1:]:
        m = _mtbf_min(n)
        # synchronous: training stops for the whole save, nothing runs in the background;
        # asynchronous: it stops for a tenth of it, and the write goes on for SAVE_MIN
        for kind, blocking, write in (("synchronous", SAVE_MIN, 0.0),
                                      ("asynchronous", SAVE_MIN / 10, SAVE_MIN)):
            tau = F.young_interval(blocking, m)
            rows.append({"devices": n, "mtbf_minutes": m, "kind": kind,
                         "blocking_minutes": blocking, "write_minutes": write, "interval": tau,
                         "waste_write_ignored": F.first_order_waste(tau, blocking, m),
                         "waste_with_write": F.first_order_waste(tau, blocking, m, write=write),
                         "interval_covers_write": tau >= write})
    print_table("c. exercise 9: an asynchronous save stops training for a tenth of the "
                f"{SAVE_MIN:g} minutes; while its write runs in the background a failure "
                "restarts from the save before (last two columns)",
                ["devices", "save", "stops training (min)", "tau* (min)",
                 "waste, write ignored", "waste, write counted", "background write (min)",
                 "tau* >= write"],
                [[r["devices"], {"synchronous": "sync", "asynchronous": "async"}[r["kind"]],
                  r["blocking_minutes"], r["interval"],
                  f"{100 * r['waste_write_ignored']:.2f}%", f"{100 * r['waste_with_write']:.2f}%",
                  r["write_minutes"], "yes" if r["interval_covers_write"] else "no"] for r in rows])
    return {"save_minutes": SAVE_MIN, "rows": rows}


def _measure_saves(directory: Path) -> dict:
    """Seconds a sync save of the tiny model's trained state holds training up, and an
    async one's blocked and background seconds (each after a warm-up save)."""
    import time
    from dataclasses import asdict

    import jax

    from jaxscale import garden, model as modellib
    from jaxscale.checkpoint import Checkpointer, CheckpointOptions, run_meta
    from jaxscale.parallel.plan import Plan, build_train_step
    from jaxscale.train import TrainConfig, as_arrays, init_state

    cfg = TrainConfig(model="tiny", batch_size=8)
    plan = Plan()
    _, params, optimizer = init_state(cfg)
    init, step = build_train_step(modellib.preset(cfg.model), plan, optimizer)
    batch = as_arrays(next(garden.make_corpus(cfg.seed, 64, 8).train_batches(cfg.batch_size)))
    state, _ = step(init(params), batch)  # one step: the moments are not zeros
    meta = run_meta(cfg, plan, cfg.batch_size, [], [], [], 0)
    out = {"model": cfg.model, "plan": plan.layout(), "config": asdict(cfg)}
    for kind in ("sync", "async"):
        with Checkpointer(CheckpointOptions(str(directory / kind), every=1, keep=2,
                                            async_save=kind == "async")) as ckpt:
            for n in (1, 2):  # the first save warms up (compiles, opens Orbax's threads)
                t0 = time.perf_counter()
                ckpt.save(n, step.canonical.to_canonical(state), meta)
                t1 = time.perf_counter()
                ckpt.manager.wait_until_finished()
                t2 = time.perf_counter()
            out[kind] = {"blocked_s": t1 - t0, "background_s": t2 - t1}
    out["state_bytes"] = sum(x.nbytes for x in jax.tree.leaves(state))
    return out


def part_d(lab, out: Path) -> dict:
    import tempfile

    n = 1024
    m = _mtbf_min(n)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        saves = _measure_saves(Path(tmp))
    sources = [("lecture", SAVE_MIN * 60, 0.0),
               ("measured sync", saves["sync"]["blocked_s"], 0.0),
               ("measured async", saves["async"]["blocked_s"], saves["async"]["background_s"])]
    rows = []
    for source, delta_s, write_s in sources:
        delta = delta_s / 60  # minutes, the unit of M
        tau = F.young_interval(delta, m)
        rows.append({"source": source, "save_seconds": delta_s, "write_seconds": write_s,
                     "save_minutes": delta, "young_interval_minutes": tau,
                     "young_interval_seconds": tau * 60,
                     "waste": F.first_order_waste(tau, delta, m, write=write_s / 60)})
    print_table(f"d. delta measured here ({saves['model']} model, {saves['plan']}, "
                f"{saves['state_bytes']:,} bytes of state) against the lecture's "
                f"{SAVE_MIN:g} min: Young's tau* = sqrt(2 delta M) on {n} devices, "
                f"M = {m:.0f} min",
                ["delta from", "delta (s)", "background write (s)", "Young tau* (min)",
                 "tau* (s)", "waste at tau*"],
                [[r["source"], r["save_seconds"], r["write_seconds"],
                  r["young_interval_minutes"], r["young_interval_seconds"],
                  f"{100 * r['waste']:.3f}%"] for r in rows])
    return {"devices": n, "mtbf_minutes": m, "measured": saves, "rows": rows}


PARTS = {"a": part_a, "b": part_b, "c": part_c, "d": part_d}
TITLES = {"a": "cluster MTBF", "b": "Young and Daly intervals", "c": "asynchronous checkpoints",
          "d": "measured checkpoint time"}


def main(argv=None) -> int:
    return run_experiment("failures", __doc__, PARTS, TITLES, lambda seed: None, argv)


if __name__ == "__main__":
    sys.exit(main())
