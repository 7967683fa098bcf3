"""ZeRO's layout on the dp axis: flat, padded, K-way sliced copies of the parameters, one
class per stage (`zero_layout(shapes, k, stage)` picks it).

Every parameter tensor is flattened and padded with zeros to a multiple of K (the dp size)
and cut into K equal slices; device i owns slice i. A block parameter (leading `layers`
axis, L layers) is flattened per layer, to [L, K*c], so each device owns [L, c]: one
layer's slices can be gathered on their own.

  ZeroLayout   stage 1: the optimizer's copy (state, fp32 master) is sliced; the gradients
               are reduce-scattered once per step
  Zero2Layout  stage 2: ... and reduce-scattered every micro-batch, accumulated as slices
  Zero3Layout  stage 3: the working parameters are slices too; autodiff reduce-scatters
               the gradients (the transpose of each unit's parameter all-gather)
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxscale.model import stack
from jaxscale.parallel import layouts
from jaxscale.parallel.axes import DP

STACKED = "blocks"  # the parameter subtree whose leaves carry a leading layers axis


def is_stacked(path) -> bool:
    """Whether a parameter path lies under the stacked blocks (a leading layers axis)."""
    return getattr(path[0], "key", None) == STACKED


def padded_size(n: int, k: int) -> int:
    """n rounded up to a multiple of k: a flat tensor's length once padded for k slices."""
    return -(-n // k) * k


class ZeroLayout(layouts.Replicated):
    """Stage 1: flat, padded, K-way sliced copies of the parameters for the optimizer (see
    the module docstring); the working parameters stay whole on every device."""

    stage = 1

    def __init__(self, shapes, k: int):
        self.shapes, self.k = shapes, k  # shapes: tree of ShapeDtypeStruct

    def flatten(self, tree):
        """Whole tensors -> [K*c] vectors, or [L, K*c] for block parameters (zero-padded)."""
        return jax.tree.map_with_path(lambda path, x: self.flat(x, is_stacked(path)), tree)

    def unflatten(self, flat):
        """The inverse of flatten (on whole, gathered arrays)."""
        return jax.tree.map(lambda f, s: self.whole(f, s.shape), flat, self.shapes)

    def flat(self, x, stacked: bool):
        """One whole tensor -> its padded flat form ([L, K*c] if `stacked`)."""
        rows = x.reshape(x.shape[0], -1) if stacked else x.reshape(-1)
        n = rows.shape[-1]
        return jnp.pad(rows, [(0, 0)] * (rows.ndim - 1) + [(0, padded_size(n, self.k) - n)])

    @staticmethod
    def whole(f, shape):
        """One padded flat tensor -> its whole `shape` (the padding dropped)."""
        per = math.prod(shape[1:]) if f.ndim == 2 else math.prod(shape)
        return f[..., :per].reshape(shape)

    # the canonical form: the flat global arrays are exactly flatten(whole), so converting
    # is a slice and a reshape, and back a reshape and a pad
    def canonical_spec(self, info):
        """Split the whole tensor over dp along its first dimension after the layers axis
        when dp divides it: device i's flat slice is then exactly its rows of that
        dimension, and the conversion is a reshape on each device, with no communication.
        Otherwise (a dimension dp does not divide, padding) it is spread as usual."""
        lead = 1 if info.stacked else 0
        if len(info.shape) > lead and info.shape[lead] % self.k == 0:
            return P(*([None] * lead), DP)
        return None

    def copy_to_canonical(self, f, info):
        return self.whole(f, info.shape)

    def copy_from_canonical(self, x, info):
        return self.flat(x, info.stacked)

    @staticmethod
    def spec(leaf) -> P:
        """Where a flattened leaf lives: its last axis split over dp; scalars replicated."""
        return P(*([None] * (leaf.ndim - 1)), DP) if leaf.ndim else P()

    def full_params(self, params):
        """Whole parameters from a state's `params` (for evaluation; runs outside shard_map)."""
        return params

    # the rest runs inside shard_map, on one device's view
    def target(self, params):
        return self.owned(params)

    def owned(self, params):
        """Whole tensors -> this device's flat slices (inside shard_map)."""
        i = lax.axis_index(DP)
        return jax.tree.map(lambda f: lax.dynamic_slice_in_dim(f, i * (f.shape[-1] // self.k),
                                                               f.shape[-1] // self.k, axis=-1),
                            self.flatten(params))

    def params(self, updated):
        gathered = jax.tree.map(
            lambda s: lax.all_gather(s, DP, axis=s.ndim - 1, tiled=True, to="invarying"),
            updated)
        return self.unflatten(gathered)

    def scatter(self, grads):
        """Whole gradients -> the sum over dp of my slices: the reduce-scatter."""
        return jax.tree.map(lambda f: lax.psum_scatter(f, DP, scatter_dimension=f.ndim - 1,
                                                       tiled=True), self.flatten(grads))

    def reduction(self) -> layouts.GradReduction:
        """Whole gradients on each device's own copy, reduce-scattered once per step."""
        return layouts.GradReduction(self.scatter, own=layouts.own_copy)

    @classmethod
    def dp_bytes(cls, grad_bytes: float, plan, stage3_census=None) -> dict[str, float]:
        """A reduce-scatter of the gradients per reduction (`reductions`), then one
        all-gather of the updated slices: (K-1)/K of the bytes each."""
        k = plan.dp
        return {"reduce-scatter": cls.reductions(plan) * (k - 1) / k * grad_bytes,
                "all-gather": (k - 1) / k * grad_bytes}

    @staticmethod
    def reductions(plan) -> int:
        """Reduce-scatters of the gradients per step: one."""
        return 1

    def fetch(self, unit, layer: bool):
        """Stage 3: one unit's slices -> its whole tensors (`layer`: one block's, [c] each).

        all_gather returns a "varying" value, so its transpose in the backward pass is a
        psum_scatter: the gradient of a slice is the sum over devices of that slice.
        """
        # (a block's own entries: interleaved blocks hold the dense MLP's or the experts;
        # the first dense blocks' MLP comes out of its own entry, stack.DENSE)
        table = stack.flat(self.shapes[STACKED]) if layer else self.shapes
        shapes = {name: table[name] for name in unit}

        def whole(s, shape):
            dims = shape.shape[1:] if layer else shape.shape
            return lax.all_gather(s, DP, tiled=True)[:math.prod(dims)].reshape(dims)
        return jax.tree.map(whole, unit, shapes)

    def all_finite(self, flag):
        return lax.pmin(flag.astype(jnp.int32), DP).astype(bool)

    def global_sum(self, x):
        return lax.psum(x, DP)

    def norm(self, tree):
        return jnp.sqrt(lax.psum(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(tree)), DP))


class Zero2Layout(ZeroLayout):
    """Stage 2: every micro-batch's gradients reduce-scattered as they come, so only this
    device's slices are accumulated (with one micro-batch, stage 1's program)."""

    stage = 2

    def reduction(self) -> layouts.GradReduction:
        return layouts.GradReduction(self.scatter, every_micro=True, owned=self.target,
                                     own=layouts.own_copy)

    @staticmethod
    def reductions(plan) -> int:
        """One per micro-batch (in a pipeline: per backward tick, v per micro-batch)."""
        return plan.micro_batches * (plan.virtual if plan.pp > 1 else 1)


class Zero3Layout(ZeroLayout):
    """Stage 3: the working parameters are this device's slices too; each unit gathers its
    parameters just before it runs (`parallel.zero.gathered_units`), and the gathers'
    transposes reduce-scatter the gradients, so nothing is left to reduce."""

    stage = 3

    def params_to_canonical(self, x, info):
        return self.copy_to_canonical(x, info)

    def params_from_canonical(self, x, info):
        return self.copy_from_canonical(x, info)

    def full_params(self, params):
        return self.unflatten(params)

    def target(self, params):  # the working parameters are already this device's slices
        return params

    def params(self, updated):
        return updated

    def reduction(self) -> layouts.GradReduction:
        return layouts.GradReduction(None)

    @classmethod
    def dp_bytes(cls, grad_bytes: float, plan, stage3_census=None) -> dict[str, float]:
        """Each unit's gathers, and their transposes' reduce-scatters, from the tensor by
        tensor census (`stage3_census()`: one unit set, once per micro-batch; in a
        pipeline, every tick gathers its chunk's units forward and again in backward,
        scattering there)."""
        census = stage3_census()
        if plan.pp == 1:  # (each micro-batch's forward and backward gather their own)
            return {"all-gather": plan.micro_batches * census["all_gather"],
                    "reduce-scatter": plan.micro_batches * census["reduce_scatter"]}
        ticks = plan.micro_batches * plan.virtual
        return {"all-gather": ticks * (census["all_gather"] + census["reduce_scatter"]),
                "reduce-scatter": ticks * census["reduce_scatter"]}


ZERO_LAYOUTS = {1: ZeroLayout, 2: Zero2Layout, 3: Zero3Layout}


def zero_layout(shapes, k: int, stage: int) -> ZeroLayout:
    """The layout of ZeRO `stage` (1, 2 or 3) over k data-parallel devices."""
    return ZERO_LAYOUTS[stage](shapes, k)
