"""Lecture 13 §2 and exercise 5; day-4 §3: number formats and mixed precision, for real.

    python -m experiments.precision [--out runs/precision] [--parts abcde] [--json]

a. the formats (from ml_dtypes); exercise 5: exact integers, 1 + 2^-8, a long sum in bf16
b. gradient underflow in fp16 at loss scales 1 .. 2^24, for real and 4096x-smaller gradients
c. 400 training steps: fp32, fp16 unscaled, fp16 with dynamic scaling, bf16
d. master weights: bf16 weights updated in bf16 vs fp32 master weights
e. bytes per parameter of the real training state under each policy

Low precision here is not simulated: the forward and backward passes run in bfloat16 or
float16 on the CPU. Tables go to stdout (stderr with --json) and results.json; figures to
PNG files in --out.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from experiments._runner import log, run_experiment
from jaxscale import garden
from jaxscale.model import transformer as M, optim, precision as P
from jaxscale.training import sweep
from jaxscale.model.loss import loss_fn
from jaxscale.report import print_table, pyplot, save_figure
from jaxscale.training.config import TrainConfig
from jaxscale.training.reference import init_run
from jaxscale.model import config as model_config
from jaxscale.model import formats
from jaxscale.model.optim_states import moment_bytes, states_in
from jaxscale.parallel import step as steplib

BATCH = 8  # documents per step: small, to fit the 60 s budget with 4 policies x 400 steps
SMALL = 4096.0  # gradients as small as a 4096x larger batch would give


class Lab:
    def __init__(self, seed: int = 0):
        self.graphdef, self.params0, _ = init_run(TrainConfig(seed=seed))
        self.corpus = garden.make_corpus(seed)
        self.batches = sweep.stack_batches(self.corpus, 400, BATCH, seed=seed)
        self.val = sweep.stack_val(self.corpus)
        self.floor = self.corpus.entropy_floor
        self.n_params = model_config.param_count(model_config.preset("tiny"))


def run_policies(lab: Lab, policies: dict, optimizer_for, hypers, steps: int,
                 batch_factors=None) -> dict:
    """Train under each of `policies` ({label: Policy}) at each grid point (vmapped), all
    in one compiled program: XLA compiles the pieces the policies share once (about a
    quarter less compile time than one program per policy, measured), and each policy's
    runs are the same computation as in a program of their own (bit-identical results).
    Returns {label: (per-step metrics, final val loss)}."""
    def one(pol, h, factor, params0, batches, val):
        opt = optimizer_for(h)
        step = steplib.make_step(lab.graphdef, opt, pol, batch_factor=factor)
        state, metrics = jax.lax.scan(step, steplib.init_state(params0, opt, pol), batches)
        return metrics, sweep.val_loss(lab.graphdef, state.params, val)

    @jax.jit
    def program(hypers, factors, params0, batches, val):
        return {label: jax.vmap(lambda h, f, pol=pol: one(pol, h, f, params0, batches, val))(
            hypers, factors) for label, pol in policies.items()}

    hypers = jnp.asarray(hypers, jnp.float32)
    factors = jnp.ones(len(hypers)) if batch_factors is None else jnp.asarray(batch_factors)
    batches = jax.tree.map(lambda x: x[:steps], lab.batches)
    return jax.tree.map(np.asarray, program(hypers, factors, lab.params0, batches, lab.val))


# ------------------------------------------------------------------------------------
# a. formats and exercise 5
# ------------------------------------------------------------------------------------

def part_a(lab: Lab, out: Path) -> dict:
    table = formats.format_table()
    print_table("a. number formats (from ml_dtypes.finfo)",
                ["format", "bits", "exp", "mantissa", "max", "smallest normal",
                 "smallest subnormal", "eps", "decimal digits"], [list(r.values()) for r in table])
    ints = np.arange(0, 100_000, dtype=np.float32)
    exact = {}
    for fmt in ("bfloat16", "float16"):
        first_bad = int(ints[np.flatnonzero(formats.round_to(ints, fmt) != ints)[0]])
        exact[fmt] = {"exact_through": first_bad - 1, "first_inexact": first_bad,
                      "first_inexact_becomes": float(formats.round_to(first_bad, fmt))}
    near_one = {"1 + 2^-8": float(formats.round_to(1 + 2**-8, "bfloat16")),
                "1 + 2^-7": float(formats.round_to(1 + 2**-7, "bfloat16"))}

    def running_sum(xs, dtype):  # one addition at a time, each rounded to dtype
        return jax.lax.scan(lambda acc, x: (acc + x, None), jnp.zeros((), dtype), xs.astype(dtype))[0]
    sums = []
    for value, n in ((1.0, 10_000), (0.01, 10_000)):
        xs = jnp.full((n,), value, jnp.float32)
        sums.append({"adding": value, "times": n, "exact": value * n,
                     "bfloat16": float(jax.jit(running_sum, static_argnums=1)(xs, jnp.bfloat16)),
                     "float32": float(jax.jit(running_sum, static_argnums=1)(xs, jnp.float32))})
    print_table("a. exercise 5: consecutive integers exact from 0, and what the next one becomes",
                ["format", "exact through", "first inexact", "rounds to"],
                [[f, *e.values()] for f, e in exact.items()])
    print_table("a. in bfloat16 (7 mantissa bits): 1 + 2^-8 is halfway, ties go to even",
                ["value", "stored as"], [[k, v] for k, v in near_one.items()])
    print_table("a. a long sum, accumulated one addition at a time",
                ["adding", "times", "exact", "bfloat16 accumulator", "float32 accumulator"],
                [list(s.values()) for s in sums])
    return {"formats": table, "exact_integers": exact, "near_one_bf16": near_one, "sums": sums}


# ------------------------------------------------------------------------------------
# b. gradient underflow in fp16
# ------------------------------------------------------------------------------------

def activation_and_param_grads(graphdef, params, batch):
    """fp32 gradients of the loss w.r.t. the residual stream between layers and the params."""
    model = nnx.merge(graphdef, params)
    cfg = model.cfg
    tokens = batch["tokens"]

    def loss_with_probes(params, probes):  # probes: zeros added to each layer's input
        x = params["tok_embed"][tokens] + params["pos_embed"][:tokens.shape[1]]
        for layer in range(cfg.n_layers):
            x = M.block(jax.tree.map(lambda p: p[layer], params["blocks"]), x + probes[layer])
        x = M.layer_norm(x + probes[cfg.n_layers], params["ln_f"]["scale"], params["ln_f"]["bias"])
        logits = jnp.einsum("btd,vd->btv", x, params["tok_embed"])
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        return jnp.sum(nll * batch["mask"]) / jnp.sum(batch["mask"])

    probes = jnp.zeros((cfg.n_layers + 1, *tokens.shape, cfg.d_model))
    gp, ga = jax.jit(jax.grad(loss_with_probes, argnums=(0, 1)))(params, probes)
    real = np.asarray(tokens != garden.PAD_ID)  # padding positions get no gradient at all
    acts = np.asarray(ga)[:, real].ravel()
    return acts, np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(gp)])


def part_b(lab: Lab, out: Path) -> dict:
    opt, pol = optim.adam(1e-2), P.policy("fp32")
    step = steplib.make_step(lab.graphdef, opt, pol)
    state, metrics = jax.jit(lambda: jax.lax.scan(step, steplib.init_state(lab.params0, opt, pol),
                                                  jax.tree.map(lambda x: x[:100], lab.batches)))()
    batch = jax.tree.map(lambda x: x[100], lab.batches)
    acts, params = activation_and_param_grads(lab.graphdef, state.params, batch)
    rows = []
    for what, g in (("activation grads", acts), ("parameter grads", params)):
        for size, shrink in (("real batch", 1.0), ("4096x batch", SMALL)):
            for k in (0, 8, 16, 24):
                c = formats.classify(g * (2.0**k / shrink), "float16")
                nonzero = 1 - c["zero"]
                rows.append({"gradients": what, "magnitude": size, "loss_scale": f"2^{k}",
                             "normal": c["normal"] / nonzero,
                             "subnormal": c["subnormal"] / nonzero,
                             "flushed_to_zero": c["flushed"] / nonzero,
                             "overflow": c["overflow"] / nonzero,
                             "below_normal": (c["subnormal"] + c["flushed"]) / nonzero})
    print_table(f"b. fp16 storage of real gradients after 100 steps ({int(batch['mask'].sum())} "
                "target tokens), fractions of the nonzero values", ["gradients", "magnitude",
                "loss scale", "normal", "subnormal", "flushed", "overflow", "below normal"],
                [list(r.values()) for r in rows])
    print(f"train loss at step 100: {float(metrics['loss'][-1]):.4f}; "
          f"{acts.size:,} activation gradients, {params.size:,} parameter gradients")
    return {"rows": rows, "n_activation_grads": int(acts.size), "n_param_grads": int(params.size),
            "tokens_in_batch": int(batch["mask"].sum())}


# ------------------------------------------------------------------------------------
# c. training curves in low precision
# ------------------------------------------------------------------------------------

CURVES = {
    "fp32": P.policy("fp32"),
    "fp16, no scaling": P.Policy("fp16-unscaled", "float16", master_weights=True),
    "fp16, dynamic scaling": P.Policy("fp16", "float16", master_weights=True,
                                      loss_scale="dynamic", growth_interval=100),
    "bf16, no scaling": P.policy("bf16"),
}


def part_c(lab: Lab, out: Path, steps: int = 400, lr: float = 3e-3) -> dict:
    rows, curves = [], {}
    t0 = time.perf_counter()
    runs = run_policies(lab, CURVES, lambda h: optim.adam(lr), [lr, lr], steps, [1.0, SMALL])
    log(f"    {len(CURVES)} policies x 2 runs x {steps} steps: {time.perf_counter() - t0:.1f} s")
    for label in CURVES:
        m, val = runs[label]
        for i, size in enumerate(("real", "4096x smaller")):
            loss = m["loss"][i]
            curves[(label, size)] = loss
            rows.append({"run": label, "gradients": size,
                         "loss_at_100": float(loss[99]), "final_train_loss": float(loss[-10:].mean()),
                         "val_loss": float(val[i]), "gap_to_floor": float(val[i] - lab.floor),
                         "skipped_steps": int(m["skipped"][i, -1]),
                         "final_loss_scale": float(m["loss_scale"][i, -1])})
    ref = {r["gradients"]: r["val_loss"] for r in rows if r["run"] == "fp32"}
    for r in rows:
        r["vs_fp32"] = r["val_loss"] - ref[r["gradients"]]
    print_table(f"c. {steps} steps of Adam (lr {lr:g}), entropy floor {lab.floor:.4f}",
                ["run", "gradients", "loss at 100", "train loss (last 10)", "val loss", "gap",
                 "skipped", "final scale", "val - fp32"], [list(r.values()) for r in rows])
    plt = pyplot()
    # the curves that train lie on top of each other: below them, each one's distance from
    # fp32's, smoothed over 10 steps (batch noise is shared, so it cancels in the difference)
    fig, axes = plt.subplots(2, 2, figsize=(12, 7), sharex=True, sharey="row",
                             gridspec_kw={"height_ratios": [3, 2]})
    smooth = lambda x: np.convolve(x, np.ones(10) / 10, mode="valid")  # noqa: E731
    for col, size in enumerate(("real", "4096x smaller")):
        top, bottom = axes[0, col], axes[1, col]
        for i, label in enumerate(CURVES):
            top.plot(np.arange(1, steps + 1), curves[(label, size)], lw=0.8, color=f"C{i}",
                     label=label)
            if label != "fp32":
                gap = smooth(np.abs(curves[(label, size)] - curves[("fp32", size)]))
                bottom.plot(np.arange(10, steps + 1), np.maximum(gap, 1e-6), lw=0.9,
                            color=f"C{i}")
        top.axhline(lab.floor, color="k", ls="--", lw=0.8,
                    label=f"entropy floor {lab.floor:.3f}")
        top.set(title=f"gradients: {size}")
        bottom.set(xlabel="step", yscale="log")
    axes[0, 0].set_ylabel("training loss (nats/token)")
    axes[1, 0].set_ylabel("|loss - fp32 loss| (nats/token),\nmean of 10 steps, log")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(f"{steps} steps of Adam (lr {lr:g}), {BATCH} documents per step")
    save_figure(fig, out / "c_training_curves.png")
    return {"rows": rows, "steps": steps, "lr": lr}


# ------------------------------------------------------------------------------------
# d. master weights
# ------------------------------------------------------------------------------------

def part_d(lab: Lab, out: Path, steps: int = 150) -> dict:
    peaks = [1e-4, 1e-3, 3e-3, 3e-3]
    cosine = [0, 0, 0, 1]  # the last run decays along a cosine to 0 at the end
    shape = optax.cosine_decay_schedule(1.0, steps)

    def optimizer_for(h):  # h = (peak lr, 1 for cosine / 0 for constant)
        return optim.adam(lambda count: h[0] * (h[1] * shape(count) + (1 - h[1])))

    rows, t0 = [], time.perf_counter()
    policies = {"bf16 weights, no master": P.policy("bf16-pure"),
                "fp32 master weights": P.policy("bf16")}
    runs = run_policies(lab, policies, optimizer_for, list(zip(peaks, cosine)), steps)
    log(f"    {len(policies)} policies x {len(peaks)} runs x {steps} steps: "
        f"{time.perf_counter() - t0:.1f} s")
    for label in policies:
        m, val = runs[label]
        for i, (peak, cos) in enumerate(zip(peaks, cosine)):
            sw = m["swallowed"][i]
            rows.append({"weights": label, "lr": f"{peak:g}" + (" cosine" if cos else ""),
                         "swallowed_mean": float(sw.mean()),
                         "swallowed_last_20pct": float(sw[int(0.8 * steps):].mean()),
                         "val_loss": float(val[i])})
    print_table(f"d. fraction of parameter updates lost (theta + dtheta == theta) over {steps} "
                "Adam steps, whole run and last 20% (a cosine schedule's tail)",
                ["weights", "lr", "swallowed (mean)", "swallowed (last 20%)", "val loss"],
                [list(r.values()) for r in rows])
    return {"rows": rows, "steps": steps}


# ------------------------------------------------------------------------------------
# e. bytes per parameter
# ------------------------------------------------------------------------------------

def part_e(lab: Lab, out: Path) -> dict:
    rows = []
    recipes = [(name, pol, "fp32") for name, pol in P.POLICIES.items()]
    recipes.append(("bf16, bf16 moments", P.POLICIES["bf16"], "bf16"))  # optim_states
    for name, pol, moments in recipes:
        state = steplib.init_state(lab.params0, states_in(moments, optim.adam(1e-3)), pol)
        grads = jax.eval_shape(jax.grad(lambda p: loss_fn(lab.graphdef, p, jax.tree.map(
            lambda x: x[0], lab.batches))), state.params)
        measured = steplib.state_bytes_per_param(state, grads, lab.n_params)
        closed = pol.bytes_per_param(moment_bytes=moment_bytes(moments) if moments != "fp32"
                                     else None)
        rows.append({"policy": name, **{k: measured[k] for k in ("params", "grads", "master",
                                                                  "optimizer")},
                     "total_measured": sum(measured.values()), "total_closed_form": sum(closed.values()),
                     "agrees": measured == closed})
    print_table(f"e. bytes per parameter of the training state with Adam ({lab.n_params:,} "
                "parameters), measured from the state pytree and the gradients' dtype",
                ["policy", "params", "grads", "master", "optimizer", "total", "closed form",
                 "agrees"], [list(r.values()) for r in rows])
    return {"rows": rows}


PARTS = {"a": part_a, "b": part_b, "c": part_c, "d": part_d, "e": part_e}
TITLES = {"a": "number formats", "b": "gradient underflow", "c": "training curves",
          "d": "master weights", "e": "bytes per parameter"}


def main(argv=None) -> int:
    return run_experiment("precision", __doc__, PARTS, TITLES, Lab, argv)


if __name__ == "__main__":
    sys.exit(main())
