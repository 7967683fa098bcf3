"""Lecture 13 §2's last step, for real: FP8 matrix multiplies and what they cost in accuracy.

    python -m experiments.fp8 [--out runs/fp8] [--parts abcd] [--json]

a. the two FP8 formats next to bf16 (from ml_dtypes): range, steps, smallest values
b. training `small` under bf16, fp8 (a scale per tensor, from this step's amax),
   fp8-delayed (from the largest amax of the last 16 steps: Transformer Engine) and
   fp8-block (a scale per 1 x 128 tile, DeepSeek-V3): the loss curves, and at every step
   the fraction of the cast values that overflow, flush to zero or fall below the normal
   range, per tensor kind
c. an outlier channel: where one scale per tensor fails and one per tile does not
d. bytes per parameter of each recipe's training state, measured, next to the closed form
   and the cost model's budget (and fp8-delayed's amax histories, per tensor)

The casts and scaled products are computed for real by XLA on this CPU (the numerics, not
the speed; jaxscale.model.fp8); the counts are taken inside the training program at each
cast (jaxscale.model.fp8_watch). Tables go to stdout (stderr with --json) and results.json;
figures to PNG files in --out.
"""
from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from experiments._runner import log, run_experiment
from jaxscale import garden
from jaxscale.costmodel import states as budgets
from jaxscale.model import config as model_config, fp8, fp8_history, fp8_watch, formats, optim
from jaxscale.model import precision as P
from jaxscale.model.optim_states import moment_bytes, states_in
from jaxscale.parallel import step as steplib
from jaxscale.parallel.build import build_train_step
from jaxscale.parallel.plan import Plan
from jaxscale.report import print_table, pyplot, save_figure
from jaxscale.training import sweep
from jaxscale.training.config import TrainConfig
from jaxscale.training.reference import init_run

MODEL, STEPS, BATCH, LR = "small", 24, 4, 1e-3  # sized to keep the experiment within 60 s
POLICIES = ("bf16", "fp8", "fp8-delayed", "fp8-block")


class Lab:
    def __init__(self, seed: int = 0):
        self.cfg = TrainConfig(model=MODEL, seed=seed, lr=LR, warmup=3, steps=STEPS,
                               batch_size=BATCH)
        self.model_cfg = model_config.preset(MODEL)
        self.graphdef, self.params0, self.optimizer = init_run(self.cfg)
        corpus = garden.make_corpus(seed)
        self.batches = sweep.stack_batches(corpus, STEPS, BATCH, seed=seed)
        self.val = sweep.stack_val(corpus)
        # one compiled validation for every policy: each evaluates bf16 working weights
        self.val_loss = jax.jit(lambda params: sweep.val_loss(self.graphdef, params, self.val))
        self.n_params = model_config.param_count(self.model_cfg)


# ------------------------------------------------------------------------------------
# a. the formats
# ------------------------------------------------------------------------------------

def part_a(lab: Lab, out: Path) -> dict:
    rows = [r for r in formats.format_table()
            if r["format"] in ("bfloat16", "float8_e4m3fn", "float8_e5m2")]
    for r in rows:  # the normal range in binades (powers of two): what a scale must fit
        r["range_normal_binades"] = float(np.log2(r["max"] / r["smallest_normal"]))
    print_table("a. FP8 next to bf16 (ml_dtypes.finfo): E4M3 for forward operands, E5M2 "
                "for gradients", ["format", "exponent bits", "mantissa bits", "max",
                                  "smallest normal", "smallest subnormal", "eps",
                                  "normal binades"],
                [[r["format"], r["exponent_bits"], r["mantissa_bits"], r["max"],
                  r["smallest_normal"], r["smallest_subnormal"], r["eps"],
                  r["range_normal_binades"]] for r in rows])
    return {"rows": rows}


# ------------------------------------------------------------------------------------
# b. training small, with the casts counted at every step
# ------------------------------------------------------------------------------------

def compile_step(lab: Lab, policy: str):
    """(first state, PlanStep, its compiled program, the Tally its casts report to): the
    program is traced inside fp8_watch.watching, so it counts its casts at every step."""
    init, step = build_train_step(lab.model_cfg, Plan(precision=policy), lab.optimizer)
    state, tally = init(lab.params0), fp8_watch.Tally()
    with fp8_watch.watching(tally):
        compiled = step.jitted.lower(state, step.place_batch(_batch(lab, 0))).compile()
    return state, step, compiled, tally


def train(lab: Lab, state, step, compiled, tally) -> dict:
    """STEPS steps of a compiled step; per step the loss and, under an FP8 recipe, each
    tensor kind's cast fractions (fp8_watch.Tally.fractions)."""
    losses, casts = [], []
    for i in range(STEPS):
        tally.reset()
        state, metrics = compiled(state, step.place_batch(_batch(lab, i)))
        losses.append(float(metrics["loss"]))  # waits for the step, so its callbacks ran
        jax.effects_barrier()
        casts.append(tally.fractions())
    val = float(lab.val_loss(step.full_params(state)))
    return {"losses": losses, "casts": casts, "val_loss": val}


def _batch(lab: Lab, i: int) -> dict:
    return jax.tree.map(lambda x: x[i], lab.batches)


def part_b(lab: Lab, out: Path) -> dict:
    t = time.perf_counter()
    # XLA compiles outside Python's lock, one program on one core: two compile side by
    # side, and each policy trains as soon as its program is ready, while the next compile
    runs = {}
    with ThreadPoolExecutor(2) as pool:
        programs = [pool.submit(compile_step, lab, policy) for policy in POLICIES]
        for policy, program in zip(POLICIES, programs):
            runs[policy] = train(lab, *program.result())
            log(f"    {policy}: compiled and {STEPS} steps by {time.perf_counter() - t:.1f} s")
    ref = runs["bf16"]
    losses = [{"policy": p, "final_train_loss": float(np.mean(r["losses"][-5:])),
               "val_loss": r["val_loss"], "val_vs_bf16": r["val_loss"] / ref["val_loss"] - 1,
               "finite": bool(np.all(np.isfinite(r["losses"])))} for p, r in runs.items()]
    print_table(f"b. {MODEL}, {STEPS} steps of Adam (lr {LR:g}), {BATCH} documents a step: "
                "the FP8 recipes against bf16", ["policy", "train loss (last 5)", "val loss",
                                                 "val vs bf16", "finite"],
                [[r["policy"], r["final_train_loss"], r["val_loss"],
                  f"{100 * r['val_vs_bf16']:+.2f}%", r["finite"]] for r in losses])
    casts = []
    for policy in POLICIES[1:]:
        for kind in fp8_watch.KINDS:
            per_step = {k: [c[kind][k] for c in runs[policy]["casts"]]
                        for k in ("overflow", "flushed", "subnormal", "unscaled_flushed")}
            casts.append({"policy": policy, "kind": kind,
                          **{k: float(np.mean(v)) for k, v in per_step.items()},
                          "flushed_max": float(np.max(per_step["flushed"])),
                          "per_step": per_step})
    print_table("b. FP8 casts per tensor kind: fraction of the nonzero values, mean over "
                f"the {STEPS} steps (unscaled: a plain cast, no scale, for contrast)",
                ["policy", "kind", "overflow", "flushed to 0", "flushed (worst step)",
                 "subnormal", "unscaled: flushed"],
                [[c["policy"], c["kind"], f"{c['overflow']:.2e}", f"{c['flushed']:.2e}",
                  f"{c['flushed_max']:.2e}", f"{c['subnormal']:.2e}",
                  f"{c['unscaled_flushed']:.2%}"] for c in casts])
    _plot_training(runs, casts, out)
    return {"model": MODEL, "steps": STEPS, "batch": BATCH, "lr": LR, "losses": losses,
            "casts": casts, "curves": {p: r["losses"] for p, r in runs.items()}}


def _plot_training(runs: dict, casts: list, out: Path) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (policy, r) in enumerate(runs.items()):
        left.plot(np.arange(1, STEPS + 1), r["losses"], color=f"C{i}", lw=1, label=policy)
    left.set(xlabel="step", ylabel="training loss (nats/token)", title="loss")
    left.legend()
    for c in casts:
        style = {"fp8": "-", "fp8-delayed": ":"}.get(c["policy"], "--")
        color = f"C{fp8_watch.KINDS.index(c['kind']) + 3}"
        right.plot(np.arange(1, STEPS + 1), np.maximum(c["per_step"]["subnormal"], 1e-9),
                   style, color=color, lw=1, label=f"{c['policy']}, {c['kind']}")
    right.set(xlabel="step", yscale="log", ylabel="fraction below E4M3/E5M2's normal range",
              title="values that lost their scale (subnormal after the cast)")
    right.legend(fontsize=7)
    save_figure(fig, out / "b_training.png")


# ------------------------------------------------------------------------------------
# c. an outlier channel: one scale per tensor against one per tile
# ------------------------------------------------------------------------------------

def part_c(lab: Lab, out: Path, rows_: int = 128, d: int = 1024, f: int = 256) -> dict:
    key_x, key_w = jax.random.split(jax.random.key(0))
    x = jax.random.normal(key_x, (rows_, d), jnp.float32)
    w = jax.random.normal(key_w, (d, f), jnp.float32) / np.sqrt(d)
    rows, rest = [], jnp.delete(jnp.arange(d), 7)  # the other channels
    for outlier in (1, 10, 100, 1_000, 10_000, 100_000):
        xo = x.at[:, 7].multiply(outlier)  # channel 7 of every row: an outlier feature
        exact = xo[:, rest] @ w[rest]  # what the other channels contribute to x @ W
        for recipe, block in (("fp8", 0), ("fp8-block", fp8.BLOCK)):
            tiles = fp8.blocks("td,df->tf", (xo.shape, w.shape), block)[0] if block else None
            q, scale = fp8.quantize(xo, fp8.E4M3, tiles)
            counts = dict(zip(fp8_watch.COUNTS, np.asarray(fp8_watch.tally(
                xo, fp8.scaled(xo, scale, tiles), q, fp8.E4M3)).tolist()))
            back = fp8.dequantize(q, scale, tiles)[:, rest]
            rows.append({"outlier": outlier, "recipe": recipe,
                         "flushed": counts["flushed"] / counts["nonzero"],
                         "subnormal": counts["subnormal"] / counts["nonzero"],
                         "other_channels_rel_error": _relative(back, xo[:, rest]),
                         "other_channels_product_rel_error": _relative(back @ w[rest], exact)})
    print_table(f"c. an activation [{rows_} x {d}] ~ N(0, 1) with channel 7 times the outlier, "
                f"in E4M3 with a scale per tensor or per 1 x {fp8.BLOCK} tile: what the "
                f"outlier costs the other channels, and their product with W [{d} x {f}]",
                ["outlier", "recipe", "flushed to 0", "subnormal", "other channels' error",
                 "their product's error"],
                [[r["outlier"], r["recipe"], f"{r['flushed']:.2%}", f"{r['subnormal']:.2%}",
                  f"{r['other_channels_rel_error']:.2e}",
                  f"{r['other_channels_product_rel_error']:.2e}"] for r in rows])
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, recipe in enumerate(("fp8", "fp8-block")):
        mine = [r for r in rows if r["recipe"] == recipe]
        ax.loglog([r["outlier"] for r in mine],
                  [r["other_channels_product_rel_error"] for r in mine], "o-", color=f"C{i}",
                  label=recipe)
    ax.set(xlabel="outlier channel's magnitude (x N(0, 1))",
           ylabel="relative error, the other channels' x @ W",
           title="one scale per tensor vs per tile")
    ax.legend()
    save_figure(fig, out / "c_outlier.png")
    return {"rows": rows}


def _relative(approx, exact) -> float:
    return float(jnp.linalg.norm(approx - exact) / jnp.linalg.norm(exact))


# ------------------------------------------------------------------------------------
# d. bytes per parameter
# ------------------------------------------------------------------------------------

def part_d(lab: Lab, out: Path) -> dict:
    rows = []
    recipes = [("bf16", "fp32"), ("fp8", "fp32"), ("fp8-delayed", "fp32"),
               ("fp8-block", "fp32"), ("fp8", "bf16"), ("fp8-block", "bf16")]
    family = lab.model_cfg.family
    for name, moments in recipes:
        pol = P.policy(name)
        state = steplib.init_state(lab.params0, states_in(moments, optim.adam(1e-3)), pol)
        measured = steplib.state_bytes_per_param(state, state.params, lab.n_params)
        closed = pol.bytes_per_param(moment_bytes=moment_bytes(moments) if moments != "fp32"
                                     else None)
        budget = budgets.per_param(1, budget="bf16-moments" if moments == "bf16"
                                   else "mixed-adam")
        rows.append({"policy": name, "moments": moments, **measured,
                     "total_measured": sum(measured.values()),
                     "total_closed_form": sum(closed.values()), "agrees": measured == closed,
                     "cost_model_budget": budget["device"],
                     "meets_budget": sum(measured.values()) == budget["device"],
                     # fp8-delayed's amax histories: per tensor, so bytes, not per parameter
                     "amax_history_bytes": sum(x.nbytes for x in jax.tree.leaves(state.fp8)),
                     "amax_history_closed_form": fp8_history.nbytes(
                         lab.model_cfg.n_layers, 7 if family.mlp == "swiglu" else 6,
                         pol.fp8_history, pol.fp8_head) if pol.fp8_history else 0})
    print_table(f"d. bytes per parameter of the training state with Adam ({lab.n_params:,} "
                "parameters), measured from the state pytree, next to the closed form "
                "(Policy.bytes_per_param) and the cost model's budget (mixed-adam, "
                "bf16-moments). The cost model's fp8 budget, "
                f"{sum(budgets.BUDGETS['fp8'])} B, stores FP8 weights; these recipes keep "
                "bf16 working weights and cast them at each product. fp8-delayed's amax "
                "histories are per tensor: bytes in all, measured and closed form",
                ["policy", "moments", "params", "grads", "master", "optimizer", "total",
                 "closed form", "agrees", "cost model", "equal", "history B",
                 "history closed form"],
                [list(r.values()) for r in rows])
    return {"rows": rows}


PARTS = {"a": part_a, "b": part_b, "c": part_c, "d": part_d}
TITLES = {"a": "the formats", "b": "training small under FP8", "c": "an outlier channel",
          "d": "bytes per parameter"}


def main(argv=None) -> int:
    return run_experiment("fp8", __doc__, PARTS, TITLES, Lab, argv)


if __name__ == "__main__":
    sys.exit(main())
