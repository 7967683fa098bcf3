"""Many garden-LM training runs, with different optimizers, in one compiled program.

`sweep.make_sweep` vmaps one optimizer over a learning-rate grid: one compile per
optimizer. Here the parameters of every run, whatever its optimizer, are stacked on one
axis, one vmapped loss gives all their gradients at each step, and each optimizer then
updates its own rows of the stack. XLA compiles the model's forward and backward pass,
most of a program's compile time on CPU, once for all the runs instead of once per
optimizer. The runs do not interact: row i's update reads only row i's gradient, state
and parameters, exactly as in a run of its own (to rounding: the batched matmuls may sum
in another order).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxscale.model import optim
from jaxscale.model.loss import loss_fn
from jaxscale.training import sweep


def _update_rows(make_opt, lrs, grads, states, params):
    """One optimizer step for each row (one run per learning rate in `lrs`)."""
    def one(lr, g, s, p):
        updates, s = make_opt(lr).update(g, s, p)
        return optax.apply_updates(p, updates), s
    return jax.vmap(one)(lrs, grads, states, params)


def train_together(graphdef, runs: dict, params0, batches: dict, val: dict) -> dict:
    """Train every run of `runs`, {key: (optimizer name, hyperparameters, learning rates)},
    from params0 over the stacked `batches` (every run sees the same batches).

    Returns {key: results}, NumPy arrays with one row per learning rate: losses
    [n, steps], val_loss [n], params and opt_state (both final).
    """
    keys = list(runs)
    ends = np.cumsum([len(runs[k][2]) for k in keys])
    starts = ends - [len(runs[k][2]) for k in keys]
    rows = lambda tree, i: jax.tree.map(lambda x: x[starts[i]:ends[i]], tree)  # noqa: E731
    makers = [lambda lr, n=runs[k][0], h=runs[k][1]: optim.make(n, lr, **h) for k in keys]
    loss_and_grads = jax.vmap(jax.value_and_grad(lambda p, b: loss_fn(graphdef, p, b)),
                              in_axes=(0, None))

    @jax.jit
    def program(lrs, params0, batches, val):
        params = jax.tree.map(lambda x: jnp.broadcast_to(x, (len(lrs), *x.shape)), params0)
        states = [jax.vmap(lambda lr, p, m=m: m(lr).init(p))(rows(lrs, i), rows(params, i))
                  for i, m in enumerate(makers)]

        def step(carry, batch):
            params, states = carry
            losses, grads = loss_and_grads(params, batch)  # every run's, in one pass
            new = [_update_rows(m, rows(lrs, i), rows(grads, i), states[i], rows(params, i))
                   for i, m in enumerate(makers)]
            params = jax.tree.map(lambda *x: jnp.concatenate(x), *[p for p, _ in new])
            return (params, [s for _, s in new]), losses

        (params, states), losses = jax.lax.scan(step, (params, states), batches)
        return losses.T, jax.vmap(lambda p: sweep.val_loss(graphdef, p, val))(params), \
            params, states

    lrs = jnp.asarray([lr for k in keys for lr in runs[k][2]], jnp.float32)
    losses, val_loss, params, states = jax.tree.map(np.asarray,
                                                    program(lrs, params0, batches, val))
    return {k: {"losses": losses[starts[i]:ends[i]], "val_loss": val_loss[starts[i]:ends[i]],
                "params": rows(params, i), "opt_state": states[i]} for i, k in enumerate(keys)}
