"""The norms a block applies before each sub-layer (and multi-head latent attention to its
latents): LayerNorm and RMSNorm, both computed in float32 whatever the input's dtype."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxscale.model.family import GPT2, Family


def layer_norm(x, scale, bias=None, eps: float = 1e-5):
    """LayerNorm, computed in float32 whatever x's dtype (mixed precision keeps norms in
    fp32: in float16 the backward of rsqrt(var) overflows once var < ~6e-4)."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps) * scale
    return (y if bias is None else y + bias).astype(x.dtype)


def rms_norm(x, scale, eps: float = 1e-5):
    """RMSNorm (Zhang and Sennrich 2019): x / sqrt(mean(x^2) + eps) * scale; no mean is
    taken out and there is no bias. Float32 inside, as layer_norm."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + eps) * scale
    return y.astype(x.dtype)


def norm(x, p, family: Family = GPT2):
    """The family's norm with parameters p ({"scale"} and, for LayerNorm, maybe "bias")."""
    if family.norm == "rmsnorm":
        return rms_norm(x, p["scale"], family.norm_eps)
    return layer_norm(x, p["scale"], p.get("bias"), family.norm_eps)
