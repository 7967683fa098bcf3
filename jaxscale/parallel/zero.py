"""ZeRO: the data-parallel step without the redundant copies, as real sharding on `dp`.

Every parameter tensor is flattened and padded with zeros to a multiple of K (the dp size)
and cut into K equal slices; device i owns slice i of every tensor. Padding is exact:
padded entries get zero gradients and zero Adam moments, so they stay zero.

  stage 1  the optimizer state (and fp32 master weights) exist only as owned slices:
           reduce-scatter the gradients, update the owned slice, all-gather the parameters
  stage 2  the gradients, too, are kept only as owned slices: each micro-batch's gradients
           are reduce-scattered at once and accumulated as slices (with one micro-batch
           stages 1 and 2 are the same program)

Communication per step equals plain data parallelism: an all-reduce is a reduce-scatter
followed by an all-gather, and ZeRO only moves the update between the two.

The optimizer must be elementwise (every state leaf a scalar or shaped like its
parameter): SGD, momentum, AdaGrad, RMSProp, Adam(W) are; a factored or norm-based one
would see only a slice and is refused.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxscale import devices as devlib, precision
from jaxscale.parallel.data import AXIS, ShardedStep, accumulated_value_and_grad


class ZeroError(ValueError):
    """An optimizer or plan that ZeRO cannot shard."""


class ZeroLayout(precision.Replicated):
    """Flat, padded, K-way sliced copies of the parameters (see the module docstring)."""

    def __init__(self, shapes, k: int):
        self.shapes, self.k = shapes, k  # shapes: a tree of jax.ShapeDtypeStruct

    def flatten(self, tree):
        """Whole tensors -> flat vectors padded to a multiple of K."""
        def flat(x):
            n = x.size
            return jnp.pad(x.reshape(-1), (0, -(-n // self.k) * self.k - n))
        return jax.tree.map(flat, tree)

    def unflatten(self, flat):
        return jax.tree.map(lambda f, s: f[:math.prod(s.shape)].reshape(s.shape), flat,
                            self.shapes)

    # the rest runs inside shard_map, on one device's view
    def target(self, params):
        i = lax.axis_index(AXIS)
        return jax.tree.map(lambda f: lax.dynamic_slice_in_dim(f, i * (f.size // self.k),
                                                               f.size // self.k),
                            self.flatten(params))

    def params(self, updated):
        gathered = jax.tree.map(lambda s: lax.all_gather(s, AXIS, tiled=True, to="invarying"),
                                updated)
        return self.unflatten(gathered)

    def all_finite(self, flag):
        return lax.pmin(flag.astype(jnp.int32), AXIS).astype(bool)

    def global_sum(self, x):
        return lax.psum(x, AXIS)

    def norm(self, tree):
        return jnp.sqrt(lax.psum(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(tree)), AXIS))


def zero_value_and_grad(graphdef, layout: ZeroLayout, micro_batches: int, stage: int):
    """grad_fn for precision.make_step: (global loss, this device's slice of the gradients).

    Stage 1 accumulates whole gradients and reduce-scatters them once; stage 2
    reduce-scatters every micro-batch's gradients at once and accumulates only slices.
    """
    def scatter(grads):  # sum over devices, keep my slice: the reduce-scatter
        return jax.tree.map(lambda f: lax.psum_scatter(f, AXIS, tiled=True), layout.flatten(grads))

    identity = lambda tree: tree  # noqa: E731
    if stage >= 2:
        return accumulated_value_and_grad(graphdef, micro_batches, per_micro=scatter,
                                          after=identity, like=layout.target)
    return accumulated_value_and_grad(graphdef, micro_batches, per_micro=identity,
                                      after=scatter, like=identity)


def _check_elementwise(opt_state, target) -> None:
    sizes = {x.shape for x in jax.tree.leaves(target)}
    for leaf in jax.tree.leaves(opt_state):
        if leaf.ndim and leaf.shape not in sizes:
            raise ZeroError(f"the optimizer keeps a state tensor of shape {leaf.shape} that is not "
                            "shaped like a parameter; ZeRO shards only elementwise optimizers "
                            "(sgd, momentum, adagrad, rmsprop, adam, adamw)")


def build_zero(graphdef, plan, optimizer, pol: precision.Policy, param_shapes, devices=None):
    """(init, step) for plan.zero_stage in (1, 2) on a dp mesh."""
    devices = list(jax.devices() if devices is None else devices)[:plan.n_devices]
    mesh = devlib.make_mesh(plan.mesh_shape, devices)
    layout = ZeroLayout(param_shapes, plan.dp)
    update = precision.make_step(
        graphdef, optimizer, pol, jit=False, layout=layout,
        grad_fn=zero_value_and_grad(graphdef, layout, plan.micro_batches, plan.zero_stage))
    sliced = lambda tree: jax.tree.map(lambda x: P(AXIS) if x.ndim else P(), tree)  # noqa: E731

    def specs(state: precision.TrainState) -> precision.TrainState:
        return precision.TrainState(jax.tree.map(lambda _: P(), state.params),
                                    sliced(state.master), sliced(state.opt_state), P(), P(), P())

    def fresh_state(params32):
        return precision.init_state(params32, optimizer, pol, arrange=layout.flatten)

    abstract = jax.eval_shape(fresh_state, param_shapes)
    _check_elementwise(abstract.opt_state, jax.eval_shape(layout.flatten, param_shapes))
    state_specs = specs(abstract)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), state_specs)

    def init(params32):
        return jax.device_put(fresh_state(params32), shardings)

    compiled = jax.jit(jax.shard_map(update, mesh=mesh, in_specs=(state_specs, P(AXIS)),
                                     out_specs=(state_specs, P())))
    return init, ShardedStep(mesh, compiled)
