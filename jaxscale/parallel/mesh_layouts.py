"""The layouts of a (dp, ep, pp, cp, tp) mesh: parameters sharded over tp, pp and ep by
their logical axes, replicated over dp and cp; with ZeRO, each device's own shards sliced again
over dp (the 2-D FSDP x TP layout), one class per stage.

The canonical form of these layouts is whole tensors sharded as the plan shards the
parameters (a restore reads each device's shard straight from disk), with the blocks'
layers permuted back from the interleaved order (`layer_order`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxscale.parallel import layouts
from jaxscale.parallel.axes import DP, EP, PP, TP
from jaxscale.parallel.actions import Action
from jaxscale.runtime.vma import vary
from jaxscale.parallel.zero_layout import Zero2Layout, Zero3Layout, ZeroLayout, is_stacked


def is_spec(x) -> bool:
    """Whether x is a PartitionSpec: a leaf of a tree of specs (a spec is a tuple)."""
    return isinstance(x, P)

def layer_order(n_layers: int, pp: int, v: int, vee: bool = False) -> list[int]:
    """Interleaving: device s holds virtual stages s, s+p, ... (in a V, zbv: s and 2p-1-s;
    actions.place), so the stacked layer axis is reordered such that each device's
    contiguous share is its chunks in order. With interleaved experts (every n-th block)
    the order is of groups of n blocks (`n_layers`: the groups; see `reorder`)."""
    per = n_layers // (pp * v)
    return [Action("F", 0, c, s).virtual_stage(pp, vee) * per + i for s in range(pp)
            for c in range(v) for i in range(per)]


def reorder(x, perm):
    """A stacked tensor's layer axis in the order `perm` of its groups: each of the
    len(perm) groups holds x.shape[0] / len(perm) entries, in order (one per block without
    interleaved experts; with them n per-block entries, n - 1 dense MLPs or one set of
    experts: model.stack)."""
    per = x.shape[0] // len(perm)
    grouped = x.reshape(len(perm), per, *x.shape[1:])[jnp.asarray(perm)]
    return grouped.reshape(x.shape)


def _reorder(x, info, perm):
    """A stacked (block) tensor's layers in the order `perm` (None: as they are)."""
    return reorder(x, perm) if info.stacked and perm is not None else x


class HybridCanonical:
    """The canonical form of the tp/pp layouts: whole tensors sharded as the plan shards the
    parameters (`canonical_spec`: a restore reads each device's shard straight from disk),
    with the blocks' layers permuted back from the interleaved order (`layer_order`)."""

    def __init__(self, order):
        identity = list(order) == sorted(order)
        self.order = None if identity else list(order)
        self.inverse = None if identity else [order.index(i) for i in range(len(order))]

    def canonical_spec(self, info):
        return P(*info.spec)

    def params_to_canonical(self, x, info):
        return _reorder(x, info, self.inverse)

    def params_from_canonical(self, x, info):
        return _reorder(x, info, self.order)

    def history_to_canonical(self, history):
        return _reorder_history(history, self.inverse)

    def history_from_canonical(self, history):
        return _reorder_history(history, self.order)


def _reorder_history(history, perm):
    """fp8-delayed's histories with the blocks' layers in the order `perm` (None: as they are)."""
    if history is None or perm is None:
        return history
    return {**history, "blocks": jax.tree.map(lambda h: reorder(h, perm), history["blocks"])}


class MeshLayout(HybridCanonical, layouts.Replicated):
    """The optimizer works on each device's shards; reductions know which axes split what."""

    def __init__(self, specs, axes, order):
        HybridCanonical.__init__(self, order)
        self.specs, self.axes = specs, axes  # axes: the model-parallel mesh axes of size > 1

    def copy_to_canonical(self, x, info):  # the optimizer's copy is sharded like the params
        return self.params_to_canonical(x, info)

    def copy_from_canonical(self, x, info):
        return self.params_from_canonical(x, info)

    def all_finite(self, flag):
        if not self.axes:
            return flag
        return lax.pmin(vary(flag.astype(jnp.int32), self.axes), self.axes).astype(bool)

    def global_sum(self, x):  # counts a replicated parameter once per copy (a diagnostic)
        return lax.psum(vary(x, self.axes), self.axes) if self.axes else x

    def norm(self, tree):
        def sq(g, spec):  # a shard's sum of squares, summed over the axes that split it
            split = tuple(a for a in spec if a is not None)
            s = jnp.sum(jnp.square(g))
            return lax.psum(s, split) if split else s
        return jnp.sqrt(sum(jax.tree.leaves(jax.tree.map(sq, tree, self.specs))))


class ZeroMeshLayout(HybridCanonical, ZeroLayout):
    """ZeRO over dp on each device's tp/pp shards (`shapes`: the LOCAL shard shapes): the
    2-D FSDP x TP layout.

    The optimizer's copy of a tensor (stage 3: the parameters too) is, on each device, a
    dp slice of its own tp/pp shard flattened and padded. The canonical conversion undoes that on each device's shard:
    gather the dp slices, drop the padding, reshape (and the reverse on restore); what is
    left is a whole tensor sharded as the plan shards the parameters.
    """

    def __init__(self, local_shapes, dp: int, specs, axes, order, mesh):
        ZeroLayout.__init__(self, local_shapes, dp)
        HybridCanonical.__init__(self, order)
        self.specs, self.axes, self.mesh = specs, axes, mesh
    def _local_shape(self, info):
        spec = info.spec + (None,) * (len(info.shape) - len(info.spec))
        return tuple(d // (self.mesh.shape[a] if a else 1) for d, a in zip(info.shape, spec))

    def copy_to_canonical(self, f, info):
        shape = self._local_shape(info)

        def shard(s):  # my dp slice of my shard's flat copy -> my whole shard
            flat = lax.all_gather(s, DP, axis=s.ndim - 1, tiled=True, to="invarying")
            return self.whole(flat, shape)
        x = jax.shard_map(shard, mesh=self.mesh, in_specs=flat_spec(P(*info.spec), info.stacked),
                          out_specs=P(*info.spec))(f)
        return HybridCanonical.params_to_canonical(self, x, info)

    def copy_from_canonical(self, x, info):
        def shard(w):  # my whole shard -> my dp slice of its flat copy
            flat = self.flat(w, info.stacked)
            c = flat.shape[-1] // self.k
            return lax.dynamic_slice_in_dim(flat, lax.axis_index(DP) * c, c, axis=-1)
        return jax.shard_map(shard, mesh=self.mesh, in_specs=P(*info.spec),
                             out_specs=flat_spec(P(*info.spec), info.stacked))(
            HybridCanonical.params_from_canonical(self, x, info))

    def all_finite(self, flag):
        axes = (DP, *self.axes)
        return lax.pmin(vary(flag.astype(jnp.int32), axes), axes).astype(bool)

    def global_sum(self, x):
        axes = (DP, *self.axes)
        return lax.psum(vary(x, axes), axes)

    def norm(self, tree):
        def sq(g, spec):  # a dp slice of a shard: sum over dp and over the shard's axes
            return lax.psum(jnp.sum(jnp.square(g)), (DP, *(a for a in spec if a)))
        return jnp.sqrt(sum(jax.tree.leaves(jax.tree.map(sq, tree, self.specs))))


def flat_spec(spec: P, stacked: bool) -> P:
    """Where a ZeRO-flattened leaf lives: [L, tp x dp x c] or [tp x dp x c]."""
    split = tuple(a for a in (spec[1:] if stacked else spec) if a) + (DP,)
    return P(spec[0], split) if stacked else P(split)


def local_shapes(shapes, specs, plan):
    def local(s, spec):
        dims = [d // (getattr(plan, a) if a else 1) for d, a in
                zip(s.shape, tuple(spec) + (None,) * (len(s.shape) - len(spec)))]
        return jax.ShapeDtypeStruct(tuple(dims), s.dtype)
    return jax.tree.map(local, shapes, specs, is_leaf=is_spec)


class Zero2MeshLayout(ZeroMeshLayout, Zero2Layout):
    """ZeRO-2 on a mesh: every micro-batch's (or backward tick's) gradients reduce-scattered
    over dp as they come; the dp replicas of a pipeline stage run the same ticks, so they
    meet in the same branch of the schedule's lax.switch."""


class Zero3MeshLayout(ZeroMeshLayout, Zero3Layout):
    """ZeRO-3 on a mesh: the parameters, too, are stored as dp slices of each shard."""

    def params_to_canonical(self, x, info):
        return self.copy_to_canonical(x, info)

    def params_from_canonical(self, x, info):
        return self.copy_from_canonical(x, info)


ZERO_MESH_LAYOUTS = {1: ZeroMeshLayout, 2: Zero2MeshLayout, 3: Zero3MeshLayout}


def mesh_layout(plan, shapes, specs, order, mesh):
    """The layout of `plan` on its mesh: the parameters' shards whole, or ZeRO's stage on
    each device's shards (`shapes`: the whole parameters' shapes)."""
    model_axes = tuple(a for a in (EP, PP, TP) if getattr(plan, a) > 1)
    if plan.zero_stage:
        return ZERO_MESH_LAYOUTS[plan.zero_stage](local_shapes(shapes, specs, plan), plan.dp,
                                                  specs, model_axes, order, mesh)
    return MeshLayout(specs, model_axes, order)


def state_flat_specs(plan, specs):
    """Where the optimizer's copy of each parameter lives: like the parameter, or (ZeRO)
    as its flat dp slices."""
    if not plan.zero_stage:
        return specs
    return jax.tree_util.tree_map_with_path(lambda path, sp: flat_spec(sp, is_stacked(path)),
                                            specs, is_leaf=is_spec)
