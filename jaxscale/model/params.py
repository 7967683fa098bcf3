"""How the model's parameters are made: each an nnx.Param carrying its logical axis names
(the `axes` metadata a sharding Plan maps onto mesh axes: jaxscale.parallel.hybrid.RULES),
and the norms' scales and biases."""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx


def param(init, key, shape, axes, std=None) -> nnx.Param:
    """init(key, shape) (times `std` if given) named by `axes`, one name per dimension."""
    value = init(key, shape) if std is None else std * init(key, shape)
    assert len(axes) == len(shape), (axes, shape)
    return nnx.Param(value, axes=axes)


def zeros(shape, axes) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, jnp.float32), axes=axes)


def ones(shape, axes) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, jnp.float32), axes=axes)


class LayerNorm(nnx.Module):
    """A norm's parameters with an optional leading layers axis: a scale, and a bias for
    LayerNorm with biases (RMSNorm has none). `axis`: the name of the normed dimension
    (the residual stream's "embed"; a latent's own name in latent attention)."""

    def __init__(self, d: int, lead: tuple[int, ...] = (), bias: bool = True,
                 axis: str = "embed"):
        lead_axes = ("layers",) * len(lead)
        self.scale = ones((*lead, d), (*lead_axes, axis))
        if bias:
            self.bias = zeros((*lead, d), (*lead_axes, axis))
