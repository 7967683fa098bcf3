"""Rotary position embeddings (RoPE, Su et al. 2021): positions enter attention as rotations.

There is no position table. Before attention, each query and key vector is cut into pairs
of dimensions, and pair i of the token at position m turns by the angle m * w_i, with
w_i = theta^(-2i / head_dim) (theta = 10,000 in Llama 2, 500,000 in Llama 3). A rotation
keeps lengths, and turning q by m w and k by n w turns their dot product by (m - n) w:

    <R(m) q, R(n) k> = <q, R(n - m) k>

so the attention scores see only the distance between two tokens, never where they sit.
Positions are whatever the caller says they are: 0..T-1 for whole rows; under context
parallelism, the global positions of the tokens a device holds (jaxscale.parallel.context),
so a ring that passes rotated keys between devices computes what one device would.

The pairs here are (x[i], x[i + head_dim / 2]), the "rotate half" layout Hugging Face's
Llama uses, so weights converted from its checkpoints need no permutation. The angles and
the rotation are computed in float32 and the result cast back (mixed precision keeps
positions exact: bf16 has 8 bits of mantissa, too few for a position of 8,192).
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np


def frequencies(head_dim: int, theta: float, scaling: tuple = ()) -> np.ndarray:
    """w_i = theta^(-2i / head_dim) for the head_dim / 2 pairs, float32; with `scaling`
    (factor, low_freq_factor, high_freq_factor, original context: Llama 3.1's rope_scaling)
    the slow pairs are slowed by `factor` so that a longer context turns them no further
    than the original did, the fast ones kept, and the band between blended."""
    w = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling:
        factor, low, high, original = scaling
        wavelength = 2 * math.pi / w
        # 1 where a pair turns fast enough to keep (wavelength under original / high),
        # 0 where it is slow (over original / low), a linear blend in between
        keep = np.clip((original / wavelength - low) / (high - low), 0.0, 1.0)
        w = keep * w + (1 - keep) * w / factor
    return w.astype(np.float32)


def rotate(x, positions, theta: float, scaling: tuple = ()):
    """x [B, T, heads, head_dim] with the token at positions[t] turned by its angles."""
    w = jnp.asarray(frequencies(x.shape[-1], theta, scaling))
    angles = jnp.asarray(positions, jnp.float32)[:, None] * w[None, :]  # [T, head_dim / 2]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    x32 = x.astype(jnp.float32)
    a, b = jnp.split(x32, 2, axis=-1)
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1).astype(x.dtype)
