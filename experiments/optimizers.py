"""Lecture 13 §1: optimizers from SGD to AdamW, on 2-D toys and on the garden language.

    python -m experiments.optimizers [--out runs/optimizers] [--parts abcdef] [--json]

a. a steep bowl and a saddle point: each optimizer's best learning rate, steps to converge
b. our optimizers vs optax after 16 steps (0.0 expected), and a naive Adam that drifts
c. the garden LM: every optimizer over a learning-rate grid spanning 31.6x
d. Adam's bias correction: the step-size multiplier, and training with and without it
e. rare words: how far their embeddings move under SGD and under Adam
f. AdamW vs Adam + L2: effective weight decay against gradient size

Every number printed is computed here; tables also go to results.json and figures to PNG
files in --out.
"""
from __future__ import annotations

import sys
import time
from functools import cached_property
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

from experiments._runner import log, run_experiment
from experiments._together import train_together
from jaxscale import garden
from jaxscale.model import optim
from jaxscale.training import sweep
from jaxscale.report import print_table, pyplot, save_figure
from jaxscale.training.config import TrainConfig
from jaxscale.training.reference import init_run
from jaxscale.model.loss import loss_fn

TOY_OPTIMIZERS = ("sgd", "momentum", "nesterov", "adagrad", "rmsprop", "adam")
# Garden-LM budget: 128 batches of 16 documents, one pass (the lecture: 128 x 32 docs x 4
# passes, which would take ~8x longer than this module's 60 s budget on 2 cores).
STEPS, BATCH = 128, 16
LM_GRIDS = {  # four learning rates per optimizer, a factor sqrt(10) apart: a 31.6x span
    "sgd": 0.1, "momentum": 0.01, "adagrad": 0.01, "rmsprop": 1e-3, "adam": 1e-3}
BC_PICKS = {"small": 0, "normal": 2, "large": 3}  # d: indices into c's Adam grid
DECAY_LR, DECAY_LAMBDA = 1e-2, 0.01  # f: AdamW and Adam + L2


def lr_grid(low: float) -> list[float]:
    return [float(low * 10 ** (k / 2)) for k in range(4)]


# every garden-LM run that parts c-f read: (optimizer, hyperparameters, learning rates)
LM_RUNS = {
    **{name: (name, {}, lr_grid(low)) for name, low in LM_GRIDS.items()},  # c, d, e
    "adam, no bias correction": ("adam", {"bias_correction": False},  # d
                                 [lr_grid(LM_GRIDS["adam"])[i] for i in BC_PICKS.values()]),
    "adamw": ("adamw", {"weight_decay": DECAY_LAMBDA}, [DECAY_LR]),  # f
    "adam_l2": ("adam_l2", {"l2": DECAY_LAMBDA}, [DECAY_LR]),  # f
}


class Lab:
    """The shared set-up: model, corpus, batches; the garden-LM runs, trained once."""

    def __init__(self, seed: int = 0):
        self.graphdef, self.params0, _ = init_run(TrainConfig(seed=seed))
        self.corpus = garden.make_corpus(seed)
        self.batches = sweep.stack_batches(self.corpus, STEPS, BATCH, seed=seed)
        self.val = sweep.stack_val(self.corpus)

    @cached_property
    def floor(self) -> float:
        return self.corpus.entropy_floor

    @cached_property
    def runs(self) -> dict:
        """All of LM_RUNS, trained side by side in one compiled program the first time a
        part asks (see _together): {key: losses, val_loss, params, opt_state per lr}."""
        t0 = time.perf_counter()
        runs = train_together(self.graphdef, LM_RUNS, self.params0, self.batches, self.val)
        log(f"    {sum(len(r[2]) for r in LM_RUNS.values())} garden-LM runs "
            f"({len(LM_RUNS)} optimizer settings) x {STEPS} steps: "
            f"{time.perf_counter() - t0:.1f} s")
        return runs


def finite(x) -> float | None:
    x = float(x)
    return x if np.isfinite(x) else None


# ------------------------------------------------------------------------------------
# a. 2-D problems
# ------------------------------------------------------------------------------------

PROBLEMS = {  # f, start, minimum value
    "bowl": (lambda w: 0.5 * (w[0] ** 2 + 50 * w[1] ** 2), (1.0, 1.0), 0.0),
    "saddle": (lambda w: w[0] ** 2 - w[1] ** 2 + w[1] ** 4 / 4, (1.0, 1e-4), -1.0),
}
FORMULAS = {"bowl": "f = (x² + 50 y²) / 2", "saddle": "f = x² - y² + y⁴/4"}  # for the figure
TOY_LRS = np.geomspace(1e-3, 1.0, 13)
TOY_STEPS, TOY_TOL = 1000, 1e-3


def toy_run(name: str, f, start, lr) -> jax.Array:
    """Positions [TOY_STEPS + 1, 2] of optimizer `name` on f from `start` at learning rate lr."""
    opt = optim.make(name, lr)
    w0 = jnp.asarray(start, jnp.float32)

    def step(carry, _):
        w, s = carry
        u, s = opt.update(jax.grad(f)(w), s, w)
        w = optax.apply_updates(w, u)
        return (w, s), w
    _, ws = jax.lax.scan(step, (w0, opt.init(w0)), None, length=TOY_STEPS)
    return jnp.concatenate([w0[None], ws])


@jax.jit
def toy_trajectories(lrs) -> dict:
    """{(problem, optimizer): (positions [n_lrs, TOY_STEPS + 1, 2], f - f* there)} for
    every problem and optimizer at every learning rate: one compiled program for all."""
    out = {}
    for prob, (f, start, fmin) in PROBLEMS.items():
        for name in TOY_OPTIMIZERS:
            paths = jax.vmap(lambda lr: toy_run(name, f, start, lr))(lrs)
            out[(prob, name)] = paths, jax.vmap(jax.vmap(f))(paths) - fmin
    return out


def part_a(lab: Lab, out: Path) -> dict:
    rows, best_paths = [], {}
    runs = jax.tree.map(np.asarray, toy_trajectories(jnp.asarray(TOY_LRS, jnp.float32)))
    for prob, (f, start, fmin) in PROBLEMS.items():
        for name in TOY_OPTIMIZERS:
            paths, gaps = runs[(prob, name)]  # gaps: [lrs, steps + 1]
            # converged at step t: within TOY_TOL from t to the end (a lucky pass doesn't count)
            outside = ~(np.isfinite(gaps) & (gaps < TOY_TOL))
            last_out = np.where(outside.any(1), TOY_STEPS - np.argmax(outside[:, ::-1], 1), 0)
            steps = np.where(outside[:, -1], 10**9, last_out)
            i = int(steps.argmin()) if steps.min() < 10**9 else int(np.nanargmin(
                np.where(np.isfinite(gaps[:, -1]), gaps[:, -1], np.inf)))
            converged = bool(steps[i] < 10**9)
            # the saddle's question: how soon does |y| leave the ridge (y = 1e-4) for the valley?
            escaped = np.abs(paths[i, :, 1]) > 1.0
            rows.append({"problem": prob, "optimizer": name, "best_lr": float(TOY_LRS[i]),
                         "steps_to_converge": int(steps[i]) if converged else None,
                         "final_gap": finite(gaps[i, -1]),
                         "steps_to_leave_ridge": int(escaped.argmax()) if prob == "saddle"
                         and escaped.any() else None})
            best_paths[(prob, name)] = paths[i]
    print_table(f"a. steps until f - f* stays < {TOY_TOL:g} (best of {len(TOY_LRS)} learning rates "
                f"{TOY_LRS[0]:g}..{TOY_LRS[-1]:g}, at most {TOY_STEPS} steps)",
                ["problem", "optimizer", "best lr", "steps", "f - f* at the end",
                 "steps until |y| > 1"],
                [[r["problem"], r["optimizer"], r["best_lr"],
                  r["steps_to_converge"] if r["steps_to_converge"] is not None
                  else f"> {TOY_STEPS}", r["final_gap"],
                  "" if r["problem"] == "bowl" else r["steps_to_leave_ridge"]] for r in rows])
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.5))
    shown = 200  # steps drawn: enough to see each path's shape
    best_lr = {(r["problem"], r["optimizer"]): r["best_lr"] for r in rows}
    for ax, (prob, (f, start, fmin)) in zip(axes, PROBLEMS.items()):
        xs, ys = np.meshgrid(np.linspace(-1.2, 1.2, 200), np.linspace(-1.6, 1.8, 200))
        ax.contour(xs, ys, np.asarray(f(jnp.stack([xs, ys]))), levels=30, cmap="Greys", linewidths=0.5)
        for name in TOY_OPTIMIZERS:
            p = best_paths[(prob, name)][:shown + 1]
            ax.plot(p[:, 0], p[:, 1], ".-", ms=2, lw=0.8,
                    label=f"{name}, lr {best_lr[(prob, name)]:.3g}")
        minima = [(0.0, 0.0)] if prob == "bowl" else [(0.0, 2 ** 0.5), (0.0, -(2 ** 0.5))]
        assert all(abs(float(f(jnp.asarray(m))) - fmin) < 1e-6 for m in minima)  # f* there
        ax.plot(*zip(*minima), "k*", ms=10,
                label=f"{'minimum' if len(minima) == 1 else 'minima'}, f* = {fmin:g}")
        ax.plot(*start, "ko", mfc="none", ms=7, label=f"start {start}")
        if prob == "saddle":
            ax.plot(0, 0, "kx", ms=8, label="saddle point (0, 0)")
        ax.set(title=f"{prob}: {FORMULAS[prob]}; first {shown} steps at each optimizer's "
               "best learning rate", xlim=(-1.2, 1.2), ylim=(-1.6, 1.8), xlabel="x",
               ylabel="y")
        ax.title.set_fontsize(10)
        ax.legend(fontsize=7, loc="lower left")
    save_figure(fig, out / "a_trajectories.png")
    return {"rows": rows, "lr_grid": TOY_LRS.tolist(), "tolerance": TOY_TOL,
            "max_steps": TOY_STEPS}


# ------------------------------------------------------------------------------------
# b. bit-identity with optax, and a naive Adam
# ------------------------------------------------------------------------------------

def naive_adam(lr: float, b1=0.9, b2=0.999, eps=1e-8) -> optax.GradientTransformation:
    """Adam as a textbook writes it: the same maths, b*m + (1-b)*g order, lr * (m / ...)."""
    def init(p):
        return optim.AdamState(jnp.zeros([], jnp.int32), jax.tree.map(jnp.zeros_like, p),
                               jax.tree.map(jnp.zeros_like, p))

    def update(g, s, p=None):
        t = s.count + 1
        m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, s.mu, g)
        v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, s.nu, g)
        u = jax.tree.map(lambda m, v: -lr * ((m / (1 - b1**t)) / (jnp.sqrt(v / (1 - b2**t)) + eps)),
                         m, v)
        return u, optim.AdamState(t, m, v)
    return optax.GradientTransformation(init, update)


VERIFY_STEPS = 16


def part_b(lab: Lab, out: Path) -> dict:
    pairs = {
        "sgd": (optim.sgd(0.3), optax.sgd(0.3)),
        "momentum": (optim.momentum(0.05), optax.sgd(0.05, momentum=0.9)),
        "nesterov": (optim.momentum(0.05, nesterov=True), optax.sgd(0.05, momentum=0.9, nesterov=True)),
        "adagrad": (optim.adagrad(0.05), optax.adagrad(0.05)),
        "rmsprop": (optim.rmsprop(3e-3), optax.rmsprop(3e-3)),
        "adam": (optim.adam(1e-2), optax.adam(1e-2)),
        "adamw": (optim.adamw(1e-2, weight_decay=0.1), optax.adamw(1e-2, weight_decay=0.1)),
        "naive adam (textbook order)": (naive_adam(1e-2), optax.adam(1e-2)),
    }
    # Each run's parameters as one flat vector: every optimizer here is elementwise, so
    # each number goes through the same operations as in the tree, and the 16 optimizers
    # compile as one small program instead of one per parameter tensor. (Ours and optax's
    # run in that same program, so a 0.0 still means bit-identical; the naive Adam's drift
    # differs from a tree run's in its last bits, as any recompiled program's may.)
    flat0, unravel = ravel_pytree(lab.params0)
    grad = jax.jit(jax.grad(lambda v, b: loss_fn(lab.graphdef, unravel(v), b)))
    opts = [opt for pair in pairs.values() for opt in pair]  # ours, optax, ours, optax, ...

    @jax.jit
    def update(grads, states, params):
        new = [opt.update(g, s, p) for opt, g, s, p in zip(opts, grads, states, params)]
        params = [optax.apply_updates(p, u) for p, (u, _) in zip(params, new)]
        gaps = [jnp.max(jnp.abs(params[i] - params[i + 1])) for i in range(0, len(opts), 2)]
        return params, [s for _, s in new], jnp.stack(gaps)

    params, states, diffs = [flat0] * len(opts), [opt.init(flat0) for opt in opts], []
    for t in range(VERIFY_STEPS):  # a gradient for each run: equal parameters, equal bits
        batch = jax.tree.map(lambda x: x[t], lab.batches)
        params, states, gaps = update([grad(p, batch) for p in params], states, params)
        diffs.append(gaps)  # left on the device: no wait for the host at each step
    diffs = np.asarray(jnp.stack(diffs))  # [steps, pairs]
    rows = [{"optimizer": name,
             "max_abs_diff_after": {t: float(diffs[t - 1, j]) for t in (1, 4, 16)}}
            for j, name in enumerate(pairs)]
    print_table("b. max |ours - optax| over all parameters, after t steps (jit, real gradients)",
                ["optimizer", "t = 1", "t = 4", "t = 16"],
                [[r["optimizer"], *r["max_abs_diff_after"].values()] for r in rows])
    return {"rows": rows, "steps": VERIFY_STEPS}


# ------------------------------------------------------------------------------------
# c. the garden LM over learning-rate grids
# ------------------------------------------------------------------------------------

def final_train_loss(losses: np.ndarray) -> np.ndarray:
    return losses[..., -10:].mean(-1)  # mean of the last 10 steps: less batch noise


def part_c(lab: Lab, out: Path) -> dict:
    rows = []
    for name, low in LM_GRIDS.items():
        res = lab.runs[name]
        for lr, tr, val in zip(lr_grid(low), final_train_loss(res["losses"]), res["val_loss"]):
            rows.append({"optimizer": name, "lr": lr, "train_loss": finite(tr),
                         "val_loss": finite(val), "gap": finite(val - lab.floor)})
    summary = []
    for name in LM_GRIDS:
        mine = [r for r in rows if r["optimizer"] == name and r["val_loss"] is not None]
        best = min(mine, key=lambda r: r["val_loss"])
        ok = [r["lr"] for r in mine if r["val_loss"] <= best["val_loss"] + 0.25]
        every = [r for r in rows if r["optimizer"] == name]
        summary.append({"optimizer": name, "best_lr": best["lr"], "best_val_loss": best["val_loss"],
                        "gap": best["gap"], "lr_range_within_0.25_nats": max(ok) / min(ok),
                        "worst_val_loss": None if any(r["val_loss"] is None for r in every)
                        else max(r["val_loss"] for r in every),  # None: a run diverged
                        "diverged": sum(r["val_loss"] is None or r["val_loss"] > 5 for r in every)})
    print_table(f"c. garden LM, {STEPS} batches of {BATCH} documents: validation loss "
                f"(entropy floor {lab.floor:.4f} nats/token)",
                ["optimizer", "learning rate", "train loss (last 10)", "val loss", "gap to floor"],
                [[r["optimizer"], r["lr"], r["train_loss"], r["val_loss"], r["gap"]] for r in rows])
    print_table("c. best learning rate per optimizer; how wide a range of the grid stays "
                "within 0.25 nats of that best; the worst grid point",
                ["optimizer", "best lr", "val loss", "gap", "lr range (x) within 0.25 nats",
                 "worst val loss", "diverged runs"],
                [list(s.values()) for s in summary])
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in LM_GRIDS:
        pts = [(r["lr"], r["val_loss"]) for r in rows if r["optimizer"] == name
               and r["val_loss"] is not None]
        lost = sum(r["optimizer"] == name and r["val_loss"] is None for r in rows)
        ax.plot(*zip(*pts), "o-", label=name + (f" ({lost} lr diverged, not drawn)"
                                                if lost else ""))
    ax.axhline(lab.floor, color="k", ls="--", label=f"entropy floor {lab.floor:.3f}")
    # losses span less than a decade: a linear axis; learning rates span 3 decades: log
    ax.set(xscale="log", xlabel="learning rate (log)", ylabel="validation loss (nats/token)",
           title=f"garden LM after {STEPS} steps of {BATCH} documents, "
                 "4 learning rates per optimizer")
    ax.legend()
    save_figure(fig, out / "c_loss_vs_lr.png")
    return {"rows": rows, "summary": summary, "entropy_floor": lab.floor,
            "steps": STEPS, "batch_documents": BATCH}


# ------------------------------------------------------------------------------------
# d. bias correction
# ------------------------------------------------------------------------------------

def part_d(lab: Lab, out: Path) -> dict:
    ts = (1, 2, 5, 10, 100, 1000)
    mult = {b2: [optim.bias_correction_multiplier(t, 0.9, b2) for t in ts] for b2 in (0.999, 0.95)}
    print_table("d. step-size multiplier without bias correction, (1 - b1^t) / sqrt(1 - b2^t), "
                "b1 = 0.9", ["b2", *[f"t = {t}" for t in ts]],
                [[b2, *[float(m) for m in ms]] for b2, ms in mult.items()])
    grid, picks = lr_grid(LM_GRIDS["adam"]), BC_PICKS
    with_bc, without = lab.runs["adam"], lab.runs["adam, no bias correction"]  # c's Adam
    rows = [{"lr_label": k, "lr": grid[i],
             "train_loss_with": finite(final_train_loss(with_bc["losses"][i])),
             "train_loss_without": finite(final_train_loss(without["losses"][j])),
             "val_with": finite(with_bc["val_loss"][i]), "val_without": finite(without["val_loss"][j])}
            for j, (k, i) in enumerate(picks.items())]
    print_table(f"d. one pass ({STEPS} steps), Adam with and without bias correction",
                ["learning rate", "", "train loss with", "train loss without", "val with",
                 "val without"], [list(r.values()) for r in rows])
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2), sharey=True)
    for j, (ax, (k, i)) in enumerate(zip(axes, picks.items())):
        ax.plot(np.arange(1, STEPS + 1), with_bc["losses"][i], label="with bias correction")
        ax.plot(np.arange(1, STEPS + 1), without["losses"][j], label="without")
        ax.axhline(lab.floor, color="k", ls="--", lw=0.8, label=f"entropy floor {lab.floor:.3f}")
        ax.set(title=f"{k} lr = {grid[i]:.3g}", xlabel="step")
    axes[0].set_ylabel("training loss (nats/token)")
    axes[0].legend()
    fig.suptitle(f"Adam with and without bias correction, garden LM, {STEPS} steps of {BATCH} "
                 "documents")
    save_figure(fig, out / "d_bias_correction.png")
    return {"multiplier": {str(b2): dict(zip(map(str, ts), map(float, m))) for b2, m in mult.items()},
            "rows": rows}


# ------------------------------------------------------------------------------------
# e. rare words
# ------------------------------------------------------------------------------------

def part_e(lab: Lab, out: Path) -> dict:
    docs = lab.corpus.train
    present = np.zeros((len(docs), len(garden.VOCAB)), bool)  # word i occurs in document j
    for j, d in enumerate(docs):
        present[j, d] = True
    doc_freq = present.mean(0)
    rare = [garden.WORD_ID[w] for w in garden.RARE_WORDS]
    frequent = [i for i in np.flatnonzero(doc_freq > 0.2) if i > garden.EOS_ID]
    seen = lab.batches["targets"]
    e0 = np.asarray(lab.params0["tok_embed"])
    rows = []
    for name in ("sgd", "adam"):
        grid = lr_grid(LM_GRIDS[name])
        res = lab.runs[name]
        i = int(np.nanargmin(res["val_loss"]))
        moved = np.linalg.norm(res["params"]["tok_embed"][i] - e0, axis=-1)
        rows.append({"optimizer": name, "lr": grid[i], "rare_moved": float(moved[rare].mean()),
                     "frequent_moved": float(moved[frequent].mean()),
                     "ratio_rare_to_frequent": float(moved[rare].mean() / moved[frequent].mean())})
    print_table(f"e. mean distance an embedding row moved from its initial value in one pass "
                f"(best lr); rare: {', '.join(garden.RARE_WORDS)} (seen "
                f"{int(np.isin(seen, rare).sum())} times as targets), frequent: {len(frequent)} "
                "words in > 20% of documents", ["optimizer", "lr", "rare", "frequent",
                                                "rare / frequent"], [list(r.values()) for r in rows])
    return {"rows": rows, "rare_words": list(garden.RARE_WORDS),
            "frequent_words": [garden.VOCAB[i] for i in frequent],
            "rare_target_occurrences": int(np.isin(seen, rare).sum())}


# ------------------------------------------------------------------------------------
# f. AdamW vs Adam + L2
# ------------------------------------------------------------------------------------

def part_f(lab: Lab, out: Path) -> dict:
    lr, lam = DECAY_LR, DECAY_LAMBDA
    rows, curves = [], {}
    for name in ("adamw", "adam_l2"):
        res = lab.runs[name]
        count = res["opt_state"].count[0]  # Adam's state at the end of the run
        nu = np.concatenate([np.ravel(x[0]) for x in jax.tree.leaves(res["opt_state"].nu)])
        grad_rms = np.sqrt(nu / (1 - 0.999**count))  # sqrt(v_hat): typical gradient size
        grad_rms = grad_rms[grad_rms > 1e-9]  # leave out parameters that never get a gradient
        decay = np.full_like(grad_rms, lr * lam) if name == "adamw" else lr * lam / (grad_rms + 1e-8)
        curves[name] = (grad_rms, decay)
        params = [x[0] for x in jax.tree.leaves(res["params"])]
        rows.append({"optimizer": name, "val_loss": finite(res["val_loss"][0]),
                     "weight_norm": float(np.sqrt(sum((p.astype(np.float64) ** 2).sum() for p in params))),
                     "decay_per_step_p10": float(np.percentile(decay, 10)),
                     "decay_per_step_p90": float(np.percentile(decay, 90)),
                     "decay_spread_p90_over_p10": float(np.percentile(decay, 90) / np.percentile(decay, 10))})
    init_norm = float(np.sqrt(sum((np.asarray(p, np.float64) ** 2).sum()
                                  for p in jax.tree.leaves(lab.params0))))
    print_table(f"f. AdamW vs Adam + L2 (lr {lr:g}, lambda {lam:g}, {STEPS} steps): fraction of "
                "a weight the decay term removes per step, lr*lambda for AdamW and "
                "lr*lambda/(sqrt(v_hat)+eps) for L2 (percentiles over parameters with a gradient); "
                f"initial weight norm {init_norm:.3f}",
                ["optimizer", "val loss", "weight norm", "decay p10", "decay p90", "p90 / p10"],
                [list(r.values()) for r in rows])
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for name, (g, d) in curves.items():
        keep = np.random.default_rng(0).choice(g.size, size=min(4000, g.size), replace=False)
        ax.scatter(g[keep], d[keep], s=2, alpha=0.4, label={
            "adamw": "AdamW: lr x lambda", "adam_l2": "Adam + L2: lr x lambda / (sqrt(v_hat) + eps)"}[
            name] + f"\n({keep.size:,} of the {g.size:,} parameters with a gradient)")
    ax.set(xscale="log", yscale="log", xlabel="gradient size sqrt(v_hat) (log)",
           ylabel="share of a weight decayed per step (log)",
           title=f"AdamW decays every parameter alike\n(lr {lr:g}, lambda {lam:g}, {STEPS} steps)")
    ax.legend(markerscale=5, fontsize=8, loc="upper right")
    save_figure(fig, out / "f_decay_vs_gradient.png")
    return {"rows": rows, "lr": lr, "lambda": lam, "initial_weight_norm": init_norm}


PARTS = {"a": part_a, "b": part_b, "c": part_c, "d": part_d, "e": part_e, "f": part_f}
TITLES = {"a": "2-D bowl and saddle", "b": "bit-identity with optax",
          "c": "garden LM learning-rate sweep", "d": "bias correction", "e": "rare words",
          "f": "AdamW vs Adam + L2"}


def main(argv=None) -> int:
    return run_experiment("optimizers", __doc__, PARTS, TITLES, Lab, argv)


if __name__ == "__main__":
    sys.exit(main())
