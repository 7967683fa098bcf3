"""Device variance inside shard_map: which mesh axes a value may differ over.

JAX tracks, for every value inside shard_map, the axes over which it varies from device to
device. A collective or a gradient over an axis a value does not vary over is inserted
implicitly; marking a value varying (`vary`) gives each device its own copy to
differentiate or reduce, with no implicit collective.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# The outputs of the collectives inside a block (tp's, the cp ring's, ep's all-to-alls)
# carry this name (checkpoint_name), so that a remat policy can keep them: recomputing
# one means sending it again.
COLLECTIVE = "collective"


def varying_axes(x) -> frozenset:
    """The mesh axes over which x (inside shard_map) may differ from device to device."""
    aval = jax.typeof(x)
    return frozenset(aval.manual_axis_type.varying if hasattr(aval, "manual_axis_type")
                     else aval.vma)


def vary(x, axes):
    """x marked as varying over `axes` (those it does not vary over yet): each device then
    differentiates or reduces its own copy, and no implicit collective is inserted."""
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return lax.pcast(x, missing, to="varying") if missing else x


def cotangent(x, ref):
    """x in ref's dtype, varying over ref's axes: the cotangent a vjp takes for ref."""
    return vary(x.astype(ref.dtype), tuple(sorted(varying_axes(ref))))


def zeros_like(x):
    """Zeros with x's shape, dtype and device-variance (lax.switch branches must agree)."""
    z = jnp.zeros(x.shape, x.dtype)
    return vary(z, tuple(sorted(varying_axes(x))))
