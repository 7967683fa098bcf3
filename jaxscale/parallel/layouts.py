"""Layouts: where each piece of the training state lives, and how it returns to the
canonical form (whole tensors in the model's own layer order) that checkpoints hold.

`Replicated` is the base: everything whole on every device. Sharded layouts (ZeRO's flat
slices in `parallel.zero`, the mesh layouts in `parallel.hybrid`) override its methods.

A layout also says how its gradients are reduced (`reduction`): with what collective over
dp, when, and so what the accumulator of a micro-batch scan holds. These three answers
belong together (stage 2's per-micro-batch reduce-scatter with stage 1's once-per-step
one would multiply the gradient by dp), so they come as one `GradReduction`, and the
accumulator's shape is derived from them, never given.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import optax
from jax import lax

from jaxscale.parallel.axes import DP


def identity(tree):
    """The tree unchanged: a reduction autodiff has done already, or nothing to own."""
    return tree


@dataclass(frozen=True)
class GradReduction:
    """How gradients computed on each device become the ones its optimizer applies.

    reduce       the sum over dp: an all-reduce, or a reduce-scatter to this device's
                 slice (ZeRO); None when autodiff has done it (ZeRO-3: the transposes of
                 the parameter all-gathers are reduce-scatters)
    every_micro  reduce every micro-batch's (or pipeline tick's) gradients as they come
                 (ZeRO-2: only slices are accumulated) instead of their sum once per step
    owned        the reduced gradients' layout, from the tree each device differentiates
    own          what each device differentiates: its own copy of the parameters
    then         applied after the per-step reduction (the sum over the axes that split
                 the sequence, `parallel.hybrid`)
    """

    reduce: Callable | None
    every_micro: bool = False
    owned: Callable = identity
    own: Callable = identity
    then: Callable = identity

    def per_micro(self, grads):
        """A micro-batch's (or tick's) gradients, reduced now or kept for the step's sum."""
        return self.reduce(grads) if self.reduce is not None and self.every_micro else grads

    def per_step(self, grads):
        """The accumulated gradients, reduced once per step (unless done per micro-batch)."""
        if self.reduce is not None and not self.every_micro:
            grads = self.reduce(grads)
        return self.then(grads)

    def accumulator(self, mine):
        """The zeros a micro-batch scan adds into: shaped like what per_micro returns."""
        return self.owned(mine) if self.reduce is not None and self.every_micro else mine


def psum_dp(grads):
    """The all-reduce over dp: every device ends with the sum of every device's gradients."""
    return jax.tree.map(lambda g: lax.psum(g, DP), grads)


def own_copy(params):
    """Each device's own copy of replicated parameters, to differentiate locally."""
    return jax.tree.map(lambda p: lax.pcast(p, DP, to="varying"), params)


class Replicated:
    """Where the optimizer's copy of the parameters lives: here, whole on every device.

    A sharded layout (ZeRO, `jaxscale.parallel.zero`) overrides these: `target` picks the
    slice of the working parameters a device updates, `params` rebuilds the working
    parameters from the updated slices, and the reductions make per-slice flags and sums
    global.
    """

    def reduction(self) -> GradReduction:
        """Replicated over dp: each device differentiates its own copy, one all-reduce per
        step sums them."""
        return GradReduction(psum_dp, own=own_copy)

    @staticmethod
    def dp_bytes(grad_bytes: float, plan, stage3_census=None) -> dict[str, float]:
        """Ring bytes one device sends over dp per step to reduce `grad_bytes` of gradients
        the way this layout does: one all-reduce, 2 (K-1)/K of them."""
        k = plan.dp
        return {"all-reduce": 2 * (k - 1) / k * grad_bytes}

    def target(self, params):
        return params

    def params(self, updated):
        return updated

    def all_finite(self, flag):
        return flag

    def global_sum(self, x):
        return x

    def norm(self, tree):
        return optax.tree.norm(tree)

    # The canonical form (jaxscale.parallel.canonical): whole tensors in the model's own
    # layer order, whatever the plan. A layout that stores a tensor otherwise converts it
    # here, one tensor at a time, on global arrays under jit: the working parameters
    # (`params_*`) and the optimizer's copy (`copy_*`: master weights and every
    # parameter-shaped leaf of the optimizer state). `info` is the tensor's ParamInfo.
    def canonical_spec(self, info):
        """The PartitionSpec of a whole tensor this layout converts from and to on its own
        devices; None: spread it over all devices (parallel.canonical.canonical_sharding)."""
        return None

    def params_to_canonical(self, x, info):
        return x

    def params_from_canonical(self, x, info):
        return x

    def copy_to_canonical(self, x, info):
        return x

    def copy_from_canonical(self, x, info):
        return x

    # fp8-delayed's amax histories (jaxscale.model.fp8_history): whole, replicated over the
    # data axes; a layout that reorders the blocks' layers reorders them too
    def history_to_canonical(self, history):
        return history

    def history_from_canonical(self, history):
        return history
