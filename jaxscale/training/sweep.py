"""Many short training runs in one compiled function: a hyperparameter grid as a batch axis.

`lax.scan` runs the steps and `jax.vmap` runs the grid points side by side, so a
learning-rate sweep compiles once per optimizer, not once per grid point, and each step
of all runs is one XLA call. Used by the experiments; the CLI's `train` is the
step-by-step loop with logging.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxscale import garden
from jaxscale.model.loss import nll_and_count
from jaxscale.training.reference import as_arrays, value_and_grad


def _stack(batches: list[dict]) -> dict:
    """Stack batches to [n, B, T] and drop the trailing positions that are padding in every
    batch. The loss is mathematically unchanged (attention is causal, padding is masked out)
    and the steps are cheaper; the float order of the sums changes with the shape, so
    results agree with untrimmed batches to rounding, not bit for bit."""
    stacked = {k: np.stack([b[k] for b in batches]) for k in batches[0]}
    used = np.flatnonzero(stacked["mask"].any(axis=(0, 1)))
    t = int(used[-1]) + 1 if used.size else 1
    return {k: v[..., :t] for k, v in stacked.items()}


def stack_batches(corpus: garden.Corpus, n_steps: int, batch_size: int, seed: int = 0) -> dict:
    """The first n_steps training batches, stacked: arrays of shape [n_steps, B, T]."""
    it = corpus.train_batches(batch_size, seed=seed)
    return _stack([as_arrays(next(it)) for _ in range(n_steps)])


def stack_val(corpus: garden.Corpus, batch_size: int = 128) -> dict:
    """The validation set as equal-size stacked batches (the last, ragged one is padded with
    empty documents, whose mask is all zero, so it adds nothing to the sums)."""
    docs = list(corpus.val)
    n = -(-len(docs) // batch_size) * batch_size
    empty = np.array([garden.BOS_ID], dtype=np.int32)
    return _stack([as_arrays(garden.make_batch((docs + [empty] * (n - len(docs)))[i:i + batch_size],
                                               corpus.seq_len)) for i in range(0, n, batch_size)])


def val_loss(graphdef, params, val: dict) -> jax.Array:
    """Token-weighted validation loss over stacked validation batches."""
    def body(acc, batch):
        s, c = nll_and_count(graphdef, params, batch)[:2]
        return (acc[0] + s, acc[1] + c), None
    (total, count), _ = jax.lax.scan(body, (0.0, 0.0), val)
    return total / count


def make_sweep(graphdef, make_optimizer: Callable[[jax.Array], optax.GradientTransformation],
               record: Callable | None = None):
    """A jitted run(params0, hypers[K], batches, val) -> dict of per-run results.

    `make_optimizer(h)` builds the optimizer for one grid point from its (traced) value h.
    Every run starts from params0 and sees the same batches. Results: losses [K, steps],
    val_loss [K], params [K, ...] (final), plus whatever `record(params, opt_state)`
    returns at the end, per run.
    """
    def one_run(h, params, batches, val):
        opt = make_optimizer(h)

        def step(carry, batch):
            p, s = carry
            loss, grads = value_and_grad(graphdef, p, batch)  # (+ a router's objective)
            updates, s = opt.update(grads, s, p)
            return (optax.apply_updates(p, updates), s), loss

        (p, s), losses = jax.lax.scan(step, (params, opt.init(params)), batches)
        out = {"losses": losses, "val_loss": val_loss(graphdef, p, val), "params": p}
        if record is not None:
            out["record"] = record(p, s)
        return out

    return jax.jit(jax.vmap(one_run, in_axes=(0, None, None, None)))


def run_grid(graphdef, make_optimizer, hypers, params, batches, val, record=None) -> dict:
    """Run make_sweep over `hypers` and return NumPy results (losses guarded against NaN)."""
    out = make_sweep(graphdef, make_optimizer, record)(jnp.asarray(hypers, jnp.float32),
                                                       params, batches, val)
    return jax.tree.map(np.asarray, out)
