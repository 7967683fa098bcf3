"""Day-4 notes §2: loss spikes provoked for real on the garden model, and the spike guard.

    python -m experiments.instability [--out runs/instability] [--parts ab] [--json]

Two kinds of fault, each in its own runs of the tiny model (AdamW, constant learning rate
after warm-up): bad batches (one token repeated at step 100, one 8-gram repeated at 130),
and a jump of the learning rate mid-run without warm-up (x10 at step 110).

a. without a guard: loss and gradient norm with the faults marked (figure), and the
   detections the guard's own rolling window (jaxscale.training.spikes.Window) makes on these very
   curves, offline; per fault, the first step each signal crosses its limit and by how
   many steps the gradient norm leads the loss (for jumps of x5, x10 and x20); for the x10
   jump, that lead at several thresholds z next to the false alarms they raise on a
   clean run
b. the same faults under the policies skip and rollback, next to no guard and a clean run:
   what the guard detected, the final gap to the entropy floor, the steps lost, the tokens
   wasted, the learning rate each run ended with, and its wall time (figure: the curves).
   A rollback lowers the learning rate from where it stood at the spike (x10 after the
   jump, x5 after the rollback), as PaLM and OPT lowered theirs; the jump itself fired
   once and is not replayed

No run is clipped: the AdamW that train builds (train.make_optimizer, jaxscale.model.optim.adamw)
has no gradient clipping, so "no clipping" is simply the default here. Every number
printed is measured on these runs; only the faults and the settings are chosen.
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from experiments._runner import log, run_experiment
from jaxscale.training.checkpoint.manager import CheckpointOptions
from jaxscale.report import print_table, pyplot, save_figure
from jaxscale.training.spikes import Window
from jaxscale.training.faults import parse_faults
from jaxscale.training.config import TrainConfig
from jaxscale.training.loop import train

STEPS, BATCH = 200, 8  # 8 documents a step: the step is ~2x cheaper than at 16
LR, WARMUP = 5e-3, 50  # constant after the warm-up: a jump is the only change of pace
Z, WINDOW = 6.0, 50  # the guard's defaults
CHECKPOINT_EVERY = 25  # where rollback returns to
JUMP_AT = 110  # between two checkpoints: one written at the jump's step would already
#                hold the jump's first update, and rollback would return to the damage
SCENARIOS = {"bad batches": ("spike@100:repeat", "spike@130:ngram"),
             "lr jump": (f"lr@{JUMP_AT}:10",)}
LEAD_FACTORS = (5, 10, 20)  # lr jumps whose lead is measured in part a
LEAD_STEPS = JUMP_AT + 30  # enough to see a jump's detections (the lr is constant: the
#                            shorter runs are the first steps of a long one)
LEAD_Z = (3.0, 4.0, 5.0, 6.0, 8.0)
POLICIES = ("none", "skip", "rollback")


class Lab:
    """The training runs, each trained once and shared by the parts."""

    def __init__(self, seed: int = 0):
        self.seed = seed
        self.runs: dict = {}

    def config(self, policy: str, steps: int) -> TrainConfig:
        return TrainConfig(model="tiny", steps=steps, lr=LR, lr_schedule="constant",
                           warmup=WARMUP, batch_size=BATCH, seed=self.seed, eval_every=steps,
                           n_train_docs=1024, n_val_docs=64, spike_policy=policy,
                           spike_z=Z, spike_window=WINDOW)

    def run(self, faults: tuple, policy: str, out: Path, steps: int = STEPS) -> dict:
        """A run under `faults` (() for the clean one) and spike `policy`."""
        key = (faults, policy, steps)
        if key not in self.runs:
            self.runs[key] = self._train(faults, policy, out, steps)
        return self.runs[key]

    def _train(self, faults, policy, out, steps) -> dict:
        notes = []
        with tempfile.TemporaryDirectory(dir=out) as tmp:
            t0 = time.perf_counter()
            r = train(self.config(policy, steps), out_dir=Path(tmp) / "run", progress=False,
                      log=lambda msg, kind="warning": notes.append((kind, msg)),
                      faults=parse_faults(faults),
                      # only rollback reads checkpoints: the others would just pay for them
                      checkpoint=CheckpointOptions(str(Path(tmp) / "ckpt"),
                                                   every=CHECKPOINT_EVERY)
                      if policy == "rollback" else None)
            wall = time.perf_counter() - t0
            # metrics.jsonl has a line for every step computed, rolled back ones included
            lines = [json.loads(x) for x in
                     (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
        computed = [x for x in lines if "n_tokens" in x]  # the guard's events have none
        # a step run again after a rollback has a later line: the last line of each step
        # up to the end belongs to the trajectory kept
        last = {x["step"]: i for i, x in enumerate(computed) if x["step"] <= r.steps_run}
        kept = set(last.values())
        for i, x in enumerate(computed):
            x["kept"] = i in kept
        log(f"    {policy}, {', '.join(faults) or 'no faults'}, {steps} steps: {wall:.1f} s")
        return {"faults": faults, "policy": policy, "result": r, "notes": notes,
                "wall_s": wall, "computed": computed,
                "tokens_computed": sum(x["n_tokens"] for x in computed),
                "tokens_useful": sum(x["n_tokens"] for x in computed
                                     if x["kept"] and "event" not in x)}


# ------------------------------------------------------------------------------------
# a. without a guard, watched
# ------------------------------------------------------------------------------------

def watch(losses, norms, z: float = Z, window: int = WINDOW) -> dict:
    """What the guard would have seen on these curves without acting: per step the two
    limits, which signal crossed its own, and the window's mean and std before the step.
    A step over either limit stays out of the window, as a rejected step does in train."""
    w = Window(window, z)
    out = {k: [] for k in ("loss_max", "norm_max", "loss_over", "norm_over", "mean", "std")}
    for loss, norm in zip(losses, norms):
        loss_max, norm_max = w.limits()
        mean, std = w.stats() if w.values else (np.full(2, np.nan), np.full(2, np.nan))
        out["mean"].append(mean)
        out["std"].append(std)
        out["loss_max"].append(loss_max)
        out["norm_max"].append(norm_max)
        out["loss_over"].append(loss > loss_max)
        out["norm_over"].append(norm > norm_max)
        if not (loss > loss_max or norm > norm_max):
            w.add(loss, norm)
    return {k: np.asarray(v) for k, v in out.items()}


def first_over(seen: dict, start: int, end: int) -> dict:
    """The first step in start..end-1 (steps count from 1) where each signal is over its
    limit, None where it never is."""
    def first(flags):
        return next((s for s in range(start, end) if flags[s - 1]), None)
    return {"norm": first(seen["norm_over"]), "loss": first(seen["loss_over"])}


def lead(c: dict) -> tuple[int | None, str]:
    """(steps the norm crosses before the loss, the same in words)."""
    if c["norm"] is None or c["loss"] is None:
        never = [k for k in ("norm", "loss") if c[k] is None]
        return None, "neither crossed" if len(never) == 2 else f"the {never[0]} never crossed"
    return c["loss"] - c["norm"], str(c["loss"] - c["norm"])


def fault_spans(faults, n_steps: int) -> list[tuple[int, str, int]]:
    """(step, fault, end): each fault's steps run until the next fault, or the run's end."""
    steps = [(f.step, str(f)) for f in parse_faults(faults)]
    return [(s, f, steps[i + 1][0] if i + 1 < len(steps) else n_steps + 1)
            for i, (s, f) in enumerate(steps)]


def watch_faults(run: dict) -> list[dict]:
    """Per fault of an unguarded run: where each signal first crosses, how far it goes."""
    losses, norms = np.asarray(run["result"].loss_curve), np.asarray(run["result"].grad_norms)
    seen = watch(losses, norms)
    rows = []
    for start, fault, end in fault_spans(run["faults"], len(losses)):
        c = first_over(seen, start, end)
        # how far each signal went in its first 10 steps, in std of the window before
        mean, std = seen["mean"][start - 1], seen["std"][start - 1]
        peak = [max((x[s - 1] - mean[i]) / std[i] for s in range(start, min(end, start + 10)))
                for i, x in enumerate((losses, norms))]
        steps, text = lead(c)
        rows.append({"fault": fault, "steps": f"{start}..{end - 1}",
                     "norm_first_over": c["norm"], "loss_first_over": c["loss"],
                     "lead_steps": steps, "lead": text, "norm_peak_sigmas": float(peak[1]),
                     "loss_peak_sigmas": float(peak[0]),
                     "norm_mean_std": [float(mean[1]), float(std[1])],
                     "loss_mean_std": [float(mean[0]), float(std[0])]})
    return rows


def part_a(lab: Lab, out: Path) -> dict:
    clean = lab.run((), "none", out)
    unguarded = {name: lab.run(faults, "none", out) for name, faults in SCENARIOS.items()}
    rows = watch_faults(unguarded["bad batches"])
    for k in LEAD_FACTORS:
        fault = (f"lr@{JUMP_AT}:{k}",)
        run = (unguarded["lr jump"] if fault == SCENARIOS["lr jump"]
               else lab.run(fault, "none", out, LEAD_STEPS))
        rows += watch_faults(run)
    print_table(f"a. no guard, AdamW lr {LR:g} constant, no clipping: where the guard's window "
                f"({WINDOW} steps, z = {Z:g}) would first have fired on each fault's steps; "
                "peaks over its first 10 steps, in std of the window before it",
                ["fault", "steps watched", "norm first over", "loss first over",
                 "norm leads by (steps)", "norm peak (std)", "loss peak (std)",
                 "norm mean / std before", "loss mean / std before"],
                [[r["fault"], r["steps"], r["norm_first_over"] or "never",
                  r["loss_first_over"] or "never", r["lead"], r["norm_peak_sigmas"],
                  r["loss_peak_sigmas"], "{:.3f} / {:.3f}".format(*r["norm_mean_std"]),
                  "{:.3f} / {:.3f}".format(*r["loss_mean_std"])] for r in rows])

    # the lead depends on the threshold: a lower z fires sooner, and falsely on a clean run
    jump = unguarded["lr jump"]
    losses, norms = jump["result"].loss_curve, jump["result"].grad_norms
    (start, fault, end), = fault_spans(jump["faults"], len(losses))
    by_z = []
    for z in LEAD_Z:
        c = first_over(watch(losses, norms, z), start, end)
        calm = watch(clean["result"].loss_curve, clean["result"].grad_norms, z)
        steps, text = lead(c)
        by_z.append({"z": z, "norm_first_over": c["norm"], "loss_first_over": c["loss"],
                     "lead_steps": steps, "lead": text,
                     "clean_false_alarms_norm": int(calm["norm_over"].sum()),
                     "clean_false_alarms_loss": int(calm["loss_over"].sum())})
    print_table(f"a. {fault}: the first step over the limit by threshold z, and the false "
                f"alarms of that z on the clean run ({STEPS} steps, no faults)",
                ["z", "norm first over", "loss first over", "norm leads by (steps)",
                 "false alarms: norm", "false alarms: loss"],
                [[r["z"], r["norm_first_over"] or "never", r["loss_first_over"] or "never",
                  r["lead"], r["clean_false_alarms_norm"], r["clean_false_alarms_loss"]]
                 for r in by_z])

    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(13, 7), sharex=True, sharey="row")
    for col, (name, run) in enumerate(unguarded.items()):
        r = run["result"]
        curves = (np.asarray(r.loss_curve), np.asarray(r.grad_norms))
        calm = (clean["result"].loss_curve, clean["result"].grad_norms)
        seen = watch(*curves)
        x = np.arange(1, len(curves[0]) + 1)
        for row, key in enumerate(("loss", "norm")):
            ax = axes[row, col]
            ax.plot(np.arange(1, len(calm[row]) + 1), calm[row], color="0.7", lw=0.8,
                    label="clean run")
            ax.plot(x, curves[row], color="C0", lw=0.9, label="faults, no guard")
            ax.plot(x, seen[f"{key}_max"], color="C1", ls="--", lw=0.8,
                    label=f"limit: window mean + {Z:g} std")
            over = seen[f"{key}_over"]
            ax.plot(x[over], curves[row][over], "x", color="C3", ms=6,
                    label=f"{key} over its limit")
            for step, fault, _ in fault_spans(run["faults"], len(x)):
                ax.axvline(step, color="k", lw=0.6, ls=":")
                if row == 0:
                    ax.annotate(f" {fault}", (step, 1), xycoords=("data", "axes fraction"),
                                fontsize=8, va="top", rotation=90)
            ax.set(yscale="log")
        axes[0, col].set_title(f"{name}, no guard")
        axes[1, col].set_xlabel("step")
    axes[0, 0].set_ylabel("training loss (log)")
    axes[1, 0].set_ylabel("gradient norm (log)")
    axes[1, 0].legend(fontsize=8, loc="upper left")
    fig.suptitle(f"tiny garden model, AdamW lr {LR:g}, no clipping: the detections a "
                 f"{WINDOW}-step window with z = {Z:g} would make")
    save_figure(fig, out / "a_unguarded.png")
    return {"scenarios": SCENARIOS, "rows": rows, "lead_by_z": by_z,
            "curves": {name: {"loss": run["result"].loss_curve,
                              "grad_norm": run["result"].grad_norms}
                       for name, run in unguarded.items()}}


# ------------------------------------------------------------------------------------
# b. skip and rollback
# ------------------------------------------------------------------------------------

def detections(events) -> list[dict]:
    """The guard's detections: step, the signals over their limits, what it did."""
    out = []
    for e in events:
        if e["event"] in ("spike", "nonfinite"):
            over = [name for name, v, limit in (("loss", e["loss"], e["loss_max"]),
                                                ("norm", e["grad_norm"], e["norm_max"]))
                    if v > limit]
            out.append({"step": e["step"],
                        "over": "+".join(over) if e["event"] == "spike" else "non-finite",
                        "action": e["action"], "loss": e["loss"], "grad_norm": e["grad_norm"]})
    return out


def detections_text(found: list[dict]) -> str:
    """'100 loss+norm, 111-160 (50, first norm)': consecutive steps joined."""
    groups = []
    for d in found:
        if groups and d["step"] == groups[-1][-1]["step"] + 1:
            groups[-1].append(d)
        else:
            groups.append([d])
    return ", ".join(f"{g[0]['step']} {g[0]['over']}" if len(g) == 1 else
                     f"{g[0]['step']}-{g[-1]['step']} ({len(g)}, first {g[0]['over']})"
                     for g in groups) or "none"


def final_lr_factor(events) -> float:
    """The learning rate's factor at the end: a fault multiplies it, a rollback sets it."""
    factor = 1.0
    for e in events:
        if e["event"] == "inject" and e["fault"].startswith("lr@"):
            factor *= float(e["fault"].split(":")[1])
        elif e["event"] == "rollback":
            factor = e["lr_factor"]
    return factor


def how_it_ended(run: dict) -> str:
    r = run["result"]
    if r.steps_run == STEPS:
        return f"ran all {STEPS} steps"
    why = [msg for kind, msg in run["notes"] if kind == "warning"]
    return f"stopped at step {r.steps_run}" + (f" ({why[-1]})" if why else "")


def part_b(lab: Lab, out: Path) -> dict:
    clean = lab.run((), "none", out)
    runs = [("clean", "none", clean)] + [(name, p, lab.run(faults, p, out))
                                         for name, faults in SCENARIOS.items()
                                         for p in POLICIES]
    rows = []
    for name, policy, run in runs:
        r = run["result"]
        found = detections(r.spike_events)
        kept = r.steps_run - r.skipped_steps  # the updates in the final trajectory
        rows.append({"faults": name, "policy": policy, "detections": found,
                     "detected": detections_text(found), "rollbacks": r.rollbacks,
                     "steps_run": r.steps_run, "steps_computed": r.steps_computed,
                     "updates_kept": kept, "steps_lost": r.steps_computed - kept,
                     "tokens_computed": run["tokens_computed"],
                     "tokens_wasted": run["tokens_computed"] - run["tokens_useful"],
                     "final_lr_factor": final_lr_factor(r.spike_events),
                     "val_loss": r.val_loss, "gap": r.gap,
                     "gap_vs_clean": r.gap - clean["result"].gap,
                     "wall_s": run["wall_s"], "ended": how_it_ended(run)})
    floor = clean["result"].entropy_floor
    print_table(f"b. each fault under each policy, {STEPS} steps planned; entropy floor "
                f"{floor:.4f}; steps lost = computed - updates kept; rollback returns to the "
                f"last checkpoint (every {CHECKPOINT_EVERY} steps)",
                ["faults", "policy", "detected at (signal over)", "rollbacks", "steps run",
                 "computed", "updates kept", "steps lost", "tokens wasted", "final lr factor",
                 "val loss", "gap to floor", "gap - clean", "wall s"],
                [[r["faults"], r["policy"], r["detected"], r["rollbacks"], r["steps_run"],
                  r["steps_computed"], r["updates_kept"], r["steps_lost"],
                  f"{r['tokens_wasted']:,}", r["final_lr_factor"], r["val_loss"], r["gap"],
                  r["gap_vs_clean"], r["wall_s"]] for r in rows])
    for name in SCENARIOS:
        mine = [r for r in rows if r["faults"] == name]
        unguarded = next(r for r in mine if r["policy"] == "none")
        for r in mine:
            verdict = ("" if r["policy"] == "none" else
                       f"; {'smaller' if r['gap'] < unguarded['gap'] else 'LARGER'} gap than "
                       f"no guard ({r['gap'] - unguarded['gap']:+.4f})")
            print(f"  {name}, {r['policy']}: {r['ended']}{verdict}")
    for name, policy, run in runs:
        for e in run["result"].spike_events:
            if e["event"] == "rollback":
                a, b = e["skipped_batches"]
                print(f"  {name}, {policy}: at step {e['step']} rolled back to step "
                      f"{e['to']}, batches {a}..{b} skipped, lr now x{e['lr_factor']:g}")
    # a scale for the gaps: this run differs from the clean one by two skipped updates only
    twin = next(r for r in rows if r["faults"] == "bad batches" and r["policy"] == "skip")
    print(f"  for scale: bad batches under skip is the clean run less {twin['steps_lost']} "
          f"updates (the batches the garbage replaced), and its gap differs from the clean "
          f"one by {twin['gap_vs_clean']:+.4f}")

    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(13, 7), sharex=True, sharey="row")
    for col, name in enumerate(SCENARIOS):
        shown = [("clean", clean, "0.6")] + [
            (p, run, f"C{i}") for i, (n, p, run) in enumerate(
                [x for x in runs if x[0] == name])]
        for label, run, color in shown:
            r = run["result"]
            x = np.arange(1, r.steps_run + 1)
            undone = [c for c in run["computed"] if not c["kept"]]
            for ax, curve, key in zip(axes[:, col], (r.loss_curve, r.grad_norms),
                                      ("loss", "grad_norm")):
                ax.plot(x, curve, color=color, lw=0.9, label=label)
                # the steps a rollback undid, computed and thrown away
                ax.plot([c["step"] for c in undone], [c[key] for c in undone], ".", ms=3,
                        color=color, alpha=0.7)
            found = detections(r.spike_events)  # at the values seen, undone steps too
            for ax, key in zip(axes[:, col], ("loss", "grad_norm")):
                ax.plot([d["step"] for d in found], [d[key] for d in found], "x",
                        color=color, ms=6)
        for step, fault, _ in fault_spans(SCENARIOS[name], STEPS):
            for ax in axes[:, col]:
                ax.axvline(step, color="k", lw=0.6, ls=":")
            axes[0, col].annotate(f" {fault}", (step, 1), xycoords=("data", "axes fraction"),
                                  fontsize=8, va="top", rotation=90)
        axes[0, col].axhline(floor, color="k", ls="--", lw=0.8, label="entropy floor")
        axes[0, col].set(title=name, yscale="log")
        axes[1, col].set(xlabel="step", yscale="log")
    axes[0, 0].set_ylabel("training loss (log)")
    axes[1, 0].set_ylabel("gradient norm (log)")
    axes[0, 0].legend(fontsize=8, loc="upper right")
    fig.suptitle("the trajectory each run kept; x: the guard's detections, dots: steps a "
                 "rollback undid")
    save_figure(fig, out / "b_policies.png")
    return {"scenarios": SCENARIOS, "checkpoint_every": CHECKPOINT_EVERY,
            "entropy_floor": floor, "rows": rows,
            "spike_events": {f"{n}, {p}": run["result"].spike_events for n, p, run in runs}}


PARTS = {"a": part_a, "b": part_b}
TITLES = {"a": "faults without a guard, and the lead of the gradient norm",
          "b": "skip and rollback"}


def main(argv=None) -> int:
    return run_experiment("instability", __doc__, PARTS, TITLES, Lab, argv)


if __name__ == "__main__":
    sys.exit(main())
