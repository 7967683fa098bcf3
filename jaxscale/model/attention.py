"""The core of causal self-attention, softmax(q k^T / sqrt(head_dim) + causal mask) v, and
the kernels that compute it. One function, three implementations (KERNELS):

  einsum  written out below: the T x T scores, the mask, a float32 softmax. The reference
          every other kernel is checked against; it runs anywhere.
  xla     jax.nn.dot_product_attention(is_causal=True, implementation="xla"): the same
          einsums lowered by JAX (on CPU: logits bit-identical to einsum's, gradients
          within 4e-7, tests/model/test_compute.py).
  cudnn   the same call with implementation="cudnn": cuDNN's fused flash attention, which
          never materialises the T x T scores (memory linear in T). NVIDIA GPUs only, and
          16-bit inputs only. jax.nn.dot_product_attention's default (None) is xla, so
          flash attention has to be asked for by name.

All three take q, k, v as [batch, T, heads, head_dim], the layout the model's projections
produce: tensor parallelism splits the heads axis, and each device runs its own heads
through whichever kernel. k and v may have fewer heads than q (grouped-query attention,
Ainslie et al. 2023: query head j reads k/v head j // (heads / kv_heads)); the einsum
kernel repeats them (`repeat_kv`), the fused ones take them as they are.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

KERNELS = ("einsum", "xla", "cudnn")


class KernelError(ValueError):
    """An attention kernel is unknown, or cannot run on these devices or in this dtype."""


def check_kernel(kernel: str, platform: str | None = None, compute_dtype=None) -> None:
    """Raise KernelError if `kernel` is unknown, or is cudnn on a platform other than gpu
    or with a compute dtype that is not 16-bit (each checked when given)."""
    if kernel not in KERNELS:
        raise KernelError(f"unknown attention kernel {kernel!r}; choose from "
                          f"{', '.join(KERNELS)}")
    if kernel != "cudnn":
        return
    if platform is not None and platform != "gpu":
        raise KernelError(f"cuDNN flash attention runs on NVIDIA GPUs; these devices are "
                          f"{platform}: use attention xla or einsum")
    if compute_dtype is not None and np.dtype(compute_dtype).itemsize != 2:
        raise KernelError(f"cuDNN flash attention takes bf16 or fp16, but the compute dtype "
                          f"is {np.dtype(compute_dtype).name}: use a bf16/fp16 precision "
                          "policy, or attention xla")


def repeat_kv(x, heads: int):
    """k or v [B, T, kv, K] with each head repeated for its group of query heads:
    [B, T, heads, K] (unchanged when kv == heads)."""
    kv = x.shape[2]
    return x if kv == heads else jnp.repeat(x, heads // kv, axis=2)


def causal_attention(q, k, v, segments=None):
    """softmax(q k^T / sqrt(head_dim), causal) v for q, k, v [B, T, heads, head_dim], written
    out: the reference the fused kernels are checked against. `segments` [B, T]: each
    token's document; a query then sees only the earlier keys of its own document."""
    k, v = repeat_kv(k, q.shape[2]), repeat_kv(v, q.shape[2])
    scores = jnp.einsum("bqhk,bshk->bhqs", q, k) / math.sqrt(q.shape[-1])
    t = q.shape[1]
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    if segments is not None:
        causal = causal & same_document(segments)
    scores = scores.astype(jnp.float32)  # softmax in fp32, as mixed precision does
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bhqs,bshk->bqhk", weights, v)


def same_document(segments):
    """[B, 1, T, T] True where query and key lie in the same document (segments [B, T])."""
    return (segments[:, :, None] == segments[:, None, :])[:, None]


def attend(q, k, v, kernel: str = "einsum", segments=None):
    """Causal attention of q, k, v [B, T, heads, head_dim] with `kernel` (KERNELS), within
    documents when `segments` [B, T] is given."""
    if kernel == "einsum":
        return causal_attention(q, k, v, segments)
    # the same layout; the scale 1/sqrt(head_dim) is the default
    return jax.nn.dot_product_attention(
        q, k, v, mask=None if segments is None else same_document(segments), is_causal=True,
        implementation=kernel)


class Documents:
    """The whole sequence on one device, attention kept inside documents: `segments` [B, T]
    (the model's `seq` argument; jaxscale.parallel.context.Ring is the split version)."""

    def __init__(self, segments):
        self.segments = segments

    def positions(self, t: int):
        return jnp.arange(t)

    def attend(self, q, k, v, kernel: str = "einsum"):
        return attend(q, k, v, kernel, self.segments)
