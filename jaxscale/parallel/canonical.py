"""The canonical form of a training state: one shape for every Plan, what checkpoints hold.

A plan stores its TrainState in its own layout: replicated, ZeRO's flat padded slices, tp
and pp shards, the interleaved pipeline's permuted layer order. The canonical form is the
state the single-device Plan() would hold for the same run: every tensor whole (its
logical shape), blocks in the model's layer order, the same dtypes, the loss scale and
counters beside them. A checkpoint written from any plan restores into any other:

    plan A's state --A.to_canonical--> canonical --Orbax--> disk --Orbax--> canonical
                   --B.from_canonical--> plan B's state

Each layout converts its own tensors (`layouts.Replicated.params_to_canonical` and
friends, overridden by ZeRO's and the hybrid layouts); this module applies a layout's
conversions to a whole state under jit, so the conversion is one compiled program that
moves shards between devices and never gathers the state onto one of them. The canonical
arrays are sharded too (`canonical_sharding`: over every device of the mesh along a
dimension they divide), so each device writes its own part of the checkpoint.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxscale.model import precision
from jaxscale.parallel import layouts
from jaxscale.parallel import step as steplib


@dataclass(frozen=True)
class ParamInfo:
    """What a layout needs to convert one parameter's tensors: its whole shape, whether it
    carries the stacked layers axis first, and its PartitionSpec under the plan."""

    shape: tuple
    stacked: bool
    spec: tuple = ()


def param_infos(shapes, specs=None):
    """A ParamInfo per parameter, from the whole shapes (and the plan's specs, if any)."""
    def info(path, s, spec=None):
        stacked = getattr(path[0], "key", None) == "blocks"
        return ParamInfo(tuple(s.shape), stacked, tuple(spec) if spec is not None else ())
    if specs is None:
        return jax.tree_util.tree_map_with_path(info, shapes)
    return jax.tree_util.tree_map_with_path(info, shapes, specs)


def map_state(state: steplib.TrainState, optimizer: optax.GradientTransformation, infos,
              on_params, on_copy, on_history=None) -> steplib.TrainState:
    """`state` with on_params(x, info) applied to each working parameter and on_copy(x, info)
    to the optimizer's copy: the master weights and the optimizer state's parameter trees
    (found by optax.tree_map_params; a step count or other scalar passes unchanged), and
    on_history to fp8-delayed's amax histories (if any; default: unchanged)."""
    params = jax.tree.map(on_params, state.params, infos)
    master = None if state.master is None else jax.tree.map(on_copy, state.master, infos)
    opt_state = optax.tree_map_params(optimizer, on_copy, state.opt_state, infos,
                                      transform_non_params=lambda x: x)
    history = state.fp8 if on_history is None or state.fp8 is None else on_history(state.fp8)
    return state._replace(params=params, master=master, opt_state=opt_state, fp8=history)


# The order of the mesh axes that split a canonical tensor: pp first, so that the blocks'
# layers axis divides into the pipeline stages' contiguous shares, then tp, cp, dp innermost.
CANONICAL_AXES = ("pp", "tp", "cp", "dp")


def canonical_sharding(shape, mesh) -> NamedSharding | jax.sharding.Sharding:
    """Where a canonical tensor lives: split over all of the mesh's devices along its first
    dimension that they divide, else replicated (small tensors, scalars). One device: there."""
    if mesh is None:
        return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    n = math.prod(mesh.devices.shape)
    for dim, size in enumerate(shape):
        if size % n == 0:
            return NamedSharding(mesh, P(*([None] * dim), CANONICAL_AXES))
    return NamedSharding(mesh, P())


class Canonical:
    """One plan's way to and from the canonical form.

    `to_canonical(state)` and `from_canonical(canonical)` are compiled programs (jit with
    output shardings); `target` is the canonical state's abstract tree (ShapeDtypeStructs
    with this plan's canonical shardings), what a restore reads into.
    """

    def __init__(self, layout, optimizer, pol: precision.Policy, shapes, mesh,
                 state_shardings=None, specs=None):
        self.mesh, self.layout = mesh, layout  # the layout: for explain's gradient rows
        infos = param_infos(shapes, specs)
        abstract = jax.eval_shape(lambda p: steplib.init_state(p, optimizer, pol), shapes)

        def place(x, info):  # a parameter's tensors: where the layout converts them
            spec = None if mesh is None else layout.canonical_spec(info)
            return canonical_sharding(x.shape, mesh) if spec is None else NamedSharding(mesh, spec)
        self.shardings = jax.tree.map(  # and every other leaf (scalars) spread or replicated
            lambda x: x if isinstance(x, jax.sharding.Sharding) else canonical_sharding(x.shape, mesh),
            map_state(abstract, optimizer, infos, place, place),
            is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
        self.target = jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
            abstract, self.shardings)

        def to(state):
            return map_state(state, optimizer, infos, layout.params_to_canonical,
                             layout.copy_to_canonical, layout.history_to_canonical)

        def back(canonical):
            return map_state(canonical, optimizer, infos, layout.params_from_canonical,
                             layout.copy_from_canonical, layout.history_from_canonical)

        if mesh is None and type(layout) is layouts.Replicated:  # Plan(): already canonical
            self.to_canonical = lambda state: state  # (no copy to wait for)
            # a restored state is committed to its device, a fresh one is not: uncommitted
            # (by way of the host, once per restore), the step needs one program, not two
            self.from_canonical = lambda state: jax.tree.map(
                lambda x: jnp.asarray(np.asarray(x)), state)
            return
        self.to_canonical = jax.jit(to, out_shardings=self.shardings)
        # where the plan keeps its state: what a restore puts it in, and explain reads
        self.state_shardings = state_shardings or self.shardings
        self.from_canonical = jax.jit(back, out_shardings=self.state_shardings)
