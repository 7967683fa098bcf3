"""Data parallelism: the batch split over the `dp` mesh axis, gradients all-reduced.

The whole step is one `jax.shard_map` over the mesh. Each device holds the full parameters
and optimizer state (replicated) and 1/dp of the batch:

    count  = psum(local target tokens)                 # the global token count
    grads  = sum over micro-batches of grad(local NLL sum / count)
    grads  = psum(grads)                               # THE all-reduce, once per step
    update = the precision policy's update, identical on every device

Convention: each replica differentiates its own copy of the parameters (`pcast` to
"varying"), so its gradient is the local one and the reduction is the explicit `psum`
above. (Differentiating the replicated, "invariant" parameters directly would make JAX
insert that sum itself; adding a psum on top would then give dp x the gradient.)

Dividing every shard's NLL sum by the GLOBAL count makes the loss sum(NLL)/count over the
whole batch; averaging per-shard means instead weights a shard of short documents like a
shard of long ones (`shard_mean_of_means` measures by how much).
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxscale.model import fp8_history, precision
from jaxscale.model.loss import nll_and_count
from jaxscale.parallel.canonical import Canonical
from jaxscale.parallel import layouts, step as steplib
from jaxscale.parallel.step import PlanStep, shard_step
from jaxscale.parallel.axes import DP
from jaxscale.parallel.layouts import GradReduction, Replicated
from jaxscale.runtime import mesh as meshlib
from jaxscale.runtime.vma import vary


def _split_micro_batches(batch: dict, m: int) -> dict:
    return jax.tree.map(lambda x: x.reshape(m, x.shape[0] // m, *x.shape[1:]), batch)


def accumulated_value_and_grad(nll, micro_batches: int, reduction: GradReduction,
                               batch_axes=DP):
    """The gradient function shared by plain DP, ZeRO and the non-pipelined mesh layouts,
    run inside shard_map.

    Each device differentiates `reduction.own(params)` (its own copy; ZeRO-3: its slices)
    on its micro-batches, `nll(params, micro_batch)[0]` (an NLL sum) divided by the GLOBAL
    token count, and reduces the gradients as the layout's `reduction` says: each
    micro-batch's as they come, or their sum once per step, into an accumulator shaped to
    match. Returns (global loss, reduced gradients). `batch_axes`: the mesh axes the
    batch's tokens are split over (dp; with context parallelism dp and cp).

    Under fp8-delayed (`history`, passed to `nll` third) each device also differentiates
    its own copy of the amax histories; the amaxes they report are a max over the
    micro-batches, then over `batch_axes`, returned third (jaxscale.model.fp8_history).

    A mixture of experts' `nll` returns its routers' statistics third: their objective
    (this device's contribution) joins each micro-batch's loss, 1/micro_batches of it,
    and their figures, averaged over the micro-batches and summed over `batch_axes` as
    the loss is, come back with the loss (jaxscale.parallel.step.with_router).
    """
    def grad_fn(params, batch, multiplier, history=None):
        count = lax.psum(jnp.sum(batch["mask"]), batch_axes)
        mine = reduction.own(params)
        axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
        seen = None if history is None else jax.tree.map(lambda h: vary(h, axes), history)

        def f(p, h, mb):
            out = nll(p, mb) if h is None else nll(p, mb, h)
            s = out[0] / count
            stats = out[2] if len(out) > 2 else {}
            objective = s + stats["objective"] / micro_batches if stats else s
            return (objective if multiplier is None else objective * multiplier), (s, stats)

        def micro(acc, mb):
            if seen is None:
                (_, (s, stats)), g = jax.value_and_grad(f, has_aux=True)(mine, None, mb)
                return jax.tree.map(jnp.add, acc, (s, reduction.per_micro(g))), stats
            (_, (s, stats)), (g, reported) = jax.value_and_grad(f, (0, 1), has_aux=True)(
                mine, seen, mb)
            loss, grads, amaxes = acc
            return (loss + s, jax.tree.map(jnp.add, grads, reduction.per_micro(g)),
                    jax.tree.map(jnp.maximum, amaxes, fp8_history.newest(reported))), stats

        zeros = (lax.pcast(jnp.float32(0), batch_axes, to="varying"),
                 jax.tree.map(jnp.zeros_like, reduction.accumulator(mine)))
        if seen is not None:
            zeros += (fp8_history.newest(jax.tree.map(jnp.zeros_like, seen)),)
        out, stats = lax.scan(micro, zeros, _split_micro_batches(batch, micro_batches))
        loss, grads = lax.psum(out[0], batch_axes), reduction.per_step(out[1])
        loss = steplib.with_router(loss, jax.tree.map(lambda v: v.mean(0), stats), axes)
        if seen is None:
            return loss, grads
        return loss, grads, fp8_history.pmax(out[2], axes, fp8_history.settled(loss, grads))
    return grad_fn


def dp_value_and_grad(graphdef, micro_batches: int = 1):
    """Plain data parallelism: accumulate whole gradients, then one all-reduce per step."""
    return accumulated_value_and_grad(partial(nll_and_count, graphdef), micro_batches,
                                      Replicated().reduction())


def build_data_parallel(graphdef, plan, optimizer, pol: precision.Policy, shapes,
                        devices=None):
    """(init, step) for a Plan with dp >= 1 (and micro-batches): see the module docstring."""
    devices = list(jax.devices() if devices is None else devices)[:plan.n_devices]
    mesh = meshlib.make_mesh(plan.mesh_shape, devices)
    update = steplib.make_step(graphdef, optimizer, pol, jit=False,
                                 grad_fn=dp_value_and_grad(graphdef, plan.micro_batches))
    compiled, guarded = shard_step(update, mesh, P())
    replicated = NamedSharding(mesh, P())

    def init(params32):
        state = steplib.init_state(params32, optimizer, pol)
        return jax.device_put(state, replicated)  # replicated on every device

    canonical = Canonical(layouts.Replicated(), optimizer, pol, shapes, mesh, replicated)
    return init, PlanStep(mesh, compiled, canonical=canonical, guarded=guarded)


def replicas_identical(tree) -> bool:
    """True if every device's own copy of a replicated array is bit-identical to device 0's."""
    for leaf in jax.tree.leaves(tree):
        copies = [np.asarray(s.data).tobytes() for s in leaf.addressable_shards]
        if any(c != copies[0] for c in copies[1:]):
            return False
    return True


def shard_mean_of_means(graphdef, params, batch: dict, dp: int) -> dict:
    """The token-weighted loss next to the wrong mean of per-shard means, on dp shards."""
    shards = [jax.tree.map(lambda x, i=i: np.array_split(x, dp)[i], batch) for i in range(dp)]
    sums, counts = zip(*[(float(s), float(c)) for s, c in
                         (jax.jit(nll_and_count, static_argnums=0)(graphdef, params, sh)
                          for sh in shards)])
    right = sum(sums) / sum(counts)
    wrong = float(np.mean([s / c for s, c in zip(sums, counts)]))
    return {"tokens_per_shard": [int(c) for c in counts], "token_weighted": right,
            "mean_of_shard_means": wrong, "difference": wrong - right}
