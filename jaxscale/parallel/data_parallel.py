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

from jaxscale.model import precision
from jaxscale.model.loss import nll_and_count
from jaxscale.parallel.canonical import Canonical
from jaxscale.parallel import layouts, step as steplib
from jaxscale.parallel.axes import DP as AXIS
from jaxscale.parallel.layouts import GradReduction, Replicated
from jaxscale.runtime import mesh as meshlib


def _split_micro_batches(batch: dict, m: int) -> dict:
    return jax.tree.map(lambda x: x.reshape(m, x.shape[0] // m, *x.shape[1:]), batch)


def accumulated_value_and_grad(nll, micro_batches: int, reduction: GradReduction,
                               batch_axes=AXIS):
    """The gradient function shared by plain DP, ZeRO and the non-pipelined mesh layouts,
    run inside shard_map.

    Each device differentiates `reduction.own(params)` (its own copy; ZeRO-3: its slices)
    on its micro-batches, `nll(params, micro_batch)[0]` (an NLL sum) divided by the GLOBAL
    token count, and reduces the gradients as the layout's `reduction` says: each
    micro-batch's as they come, or their sum once per step, into an accumulator shaped to
    match. Returns (global loss, reduced gradients). `batch_axes`: the mesh axes the
    batch's tokens are split over (dp; with context parallelism dp and cp).
    """
    def grad_fn(params, batch, multiplier):
        count = lax.psum(jnp.sum(batch["mask"]), batch_axes)
        mine = reduction.own(params)

        def micro(acc, mb):
            def f(p):
                s = nll(p, mb)[0] / count
                return (s if multiplier is None else s * multiplier), s
            (_, s), g = jax.value_and_grad(f, has_aux=True)(mine)
            return jax.tree.map(jnp.add, acc, (s, reduction.per_micro(g))), None

        zeros = (lax.pcast(jnp.float32(0), batch_axes, to="varying"),
                 jax.tree.map(jnp.zeros_like, reduction.accumulator(mine)))
        (loss, grads), _ = lax.scan(micro, zeros, _split_micro_batches(batch, micro_batches))
        return lax.psum(loss, batch_axes), reduction.per_step(grads)
    return grad_fn


def dp_value_and_grad(graphdef, micro_batches: int = 1):
    """Plain data parallelism: accumulate whole gradients, then one all-reduce per step."""
    return accumulated_value_and_grad(partial(nll_and_count, graphdef), micro_batches,
                                      Replicated().reduction())


class ShardedStep:
    """step(state, batch, guard=None) -> (state, metrics), what every Plan's builder
    returns: puts the batch's rows on the dp axis (`place_batch`; one device: `mesh` None),
    then runs `jitted`, the compiled program (lower it to read its HLO), or with a
    `steplib.Guard` its guarded twin `guarded` (compiled on first use: a run without a
    guard never builds it). `full_params(state)` gives whole parameters (ZeRO-3 and tp/pp
    layouts pass their own: they store shards); `canonical` converts the whole state to
    and from the plan-independent form that checkpoints hold (jaxscale.parallel.canonical)."""

    def __init__(self, mesh, jitted, full_params=None, canonical=None, guarded=None):
        self.mesh, self.jitted, self.canonical = mesh, jitted, canonical
        self.guarded = guarded or jitted  # one device: a plain jit takes the guard as is
        self.full_params = full_params or (lambda state: state.params)
        self.batch_sharding = None if mesh is None else NamedSharding(mesh, P(AXIS))
        self.guard_sharding = None if mesh is None else NamedSharding(mesh, P())

    def place_batch(self, batch: dict) -> dict:
        return jax.device_put({k: batch[k] for k in ("tokens", "targets", "mask")},
                              self.batch_sharding)

    def place_guard(self, guard: steplib.Guard) -> jax.Array:
        """The guard's scalars as one float32 vector on every device of the mesh (every
        process gives the same): one transfer a step, not one per scalar."""
        return jax.device_put(np.asarray(guard, np.float32), self.guard_sharding)

    def __call__(self, state, batch, guard: steplib.Guard | None = None):
        if guard is None:
            return self.jitted(state, self.place_batch(batch))
        return self.guarded(state, self.place_batch(batch), self.place_guard(guard))


def shard_step(update, mesh, state_specs, prepare=None, batch_spec=P(AXIS)) -> tuple:
    """(step, guarded step): `update` (steplib.make_step, jit=False) in one shard_map over
    `mesh`, the state on `state_specs`, the batch's rows on dp, the guard's vector
    replicated (ShardedStep.place_guard). With `prepare`, the batch (every row placed on
    dp, whole) is first rearranged by it under the same jit and split as `batch_spec` says
    (context parallelism: tokens in ring order, split over dp and cp)."""
    def build(*in_specs):
        mapped = jax.shard_map(update, mesh=mesh, in_specs=in_specs,
                               out_specs=(state_specs, P()))
        if prepare is None:
            return jax.jit(mapped)
        return jax.jit(lambda state, batch, *guard: mapped(state, prepare(batch), *guard))
    return build(state_specs, batch_spec), build(state_specs, batch_spec, P())


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
    return init, ShardedStep(mesh, compiled, canonical=canonical, guarded=guarded)


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
