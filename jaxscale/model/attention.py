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
  tpu-flash  Pallas's flash attention for TPUs (jax.experimental.pallas.ops.tpu): blocks
          of 128 queries and keys in the chip's vector memory, the T x T scores
          never in HBM. TPUs only; it compiles for a TPU target from this CPU machine, and
          on CPU it runs only under Pallas's interpreter (how the tests check it).

All three take q, k, v as [batch, T, heads, head_dim], the layout the model's projections
produce (tpu-flash transposes to its [batch, heads, T, head_dim]): tensor parallelism splits
the heads axis, and each device runs its own heads
through whichever kernel. k and v may have fewer heads than q (grouped-query attention,
Ainslie et al. 2023: query head j reads k/v head j // (heads / kv_heads)); the einsum
and tpu-flash kernels repeat them (`repeat_kv`), the others take them as they are.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import config as jax_config  # shard_map's device-variance check

from jaxscale.runtime.vma import varying_axes, vary

KERNELS = ("einsum", "xla", "cudnn", "tpu-flash")
FLASH_BLOCK = 128  # tpu-flash: queries and keys per block


class KernelError(ValueError):
    """An attention kernel is unknown, or cannot run on these devices or in this dtype."""


def check_kernel(kernel: str, platform: str | None = None, compute_dtype=None) -> None:
    """Raise KernelError if `kernel` is unknown, tpu-flash on a platform other than tpu, or
    cudnn on a platform other than gpu or with a compute dtype that is not 16-bit (each
    checked when given)."""
    if kernel not in KERNELS:
        raise KernelError(f"unknown attention kernel {kernel!r}; choose from "
                          f"{', '.join(KERNELS)}")
    if kernel == "tpu-flash" and platform not in (None, "tpu"):
        raise KernelError(f"tpu-flash is Pallas's TPU kernel; these devices are {platform}: "
                          "use attention einsum or xla (or compile for a TPU with --target)")
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
    if kernel == "tpu-flash":
        return tpu_flash(q, k, v, segments)
    # the same layout; the scale 1/sqrt(head_dim) is the default
    return jax.nn.dot_product_attention(
        q, k, v, mask=None if segments is None else same_document(segments), is_causal=True,
        implementation=kernel)


def tpu_flash(q, k, v, segments=None):
    """Causal attention with Pallas's TPU flash kernel: q, k, v [B, T, heads, head_dim], k and
    v repeated to q's heads, within documents when `segments` [B, T] is given. The sequence
    must be a multiple of FLASH_BLOCK (the kernel's backward and its masks work in whole
    blocks)."""
    t, heads = q.shape[1], q.shape[2]
    if t % FLASH_BLOCK:  # its backward and its document masks work in whole blocks
        raise KernelError(f"tpu-flash takes sequences of a multiple of {FLASH_BLOCK} tokens, "
                          f"got {t}: use attention einsum")
    first = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731 - [B, heads, T, head_dim]
    ids = jnp.zeros(q.shape[:2], jnp.int32) if segments is None else segments
    out = _flash(first(q), first(repeat_kv(k, heads)), first(repeat_kv(v, heads)), ids,
                 segments is not None)
    return first(out)


def _kernel_args(q, ids, documents: bool):
    """(the Pallas module, the kernel's static arguments after q, k, v, ab, segment ids)."""
    # imported when asked for: the TPU kernels are no part of a run that does not use them
    from jax.experimental.pallas.ops.tpu import flash_attention as pallas
    sizes = pallas.BlockSizes(**{f: FLASH_BLOCK if f != "block_b" else 1
                                 for f in pallas.BlockSizes.__dataclass_fields__})
    segment_ids = pallas.SegmentIds(ids, ids) if documents else None
    return pallas, segment_ids, (True, 1 / math.sqrt(q.shape[-1]), sizes, False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, ids, documents):
    """The kernel's output, varying over the mesh axes its inputs vary over (inside
    shard_map; outside it, none). Pallas states its outputs' shapes without those axes and
    shard_map's device-variance check would refuse them, so the kernel is traced with the
    check off and its results are marked varying after; this function has its own
    backward (the kernel's), so that the marks are never transposed (the transpose of a
    mark is a psum). The kernel's entry points with their residuals are Pallas's private
    ones (jax 0.10.2)."""
    return _flash_fwd(q, k, v, ids, documents)[0]


def _flash_fwd(q, k, v, ids, documents):
    pallas, segment_ids, static = _kernel_args(q, ids, documents)
    with jax_config._check_vma(False):
        o, l, m = pallas._flash_attention(q, k, v, None, segment_ids, True, *static)
    return vary(o, _axes(q, k, v)), (q, k, v, ids, o, l, m)


def _flash_bwd(documents, saved, do):
    q, k, v, ids, o, l, m = saved
    pallas, segment_ids, (causal, scale, sizes, debug) = _kernel_args(q, ids, documents)
    with jax_config._check_vma(False):
        dq, dk, dv, _, _ = pallas._flash_attention_bwd(
            False, causal, scale, sizes, debug, (q, k, v, None, segment_ids, o, l, m), do)
    axes = _axes(q, k, v)
    return (*(_cotangent(x, ref, axes) for x, ref in ((dq, q), (dk, k), (dv, v))), None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def _cotangent(x, ref, axes):
    """The kernel's gradient `x` as `ref`'s cotangent: marked varying over every input's
    axes, then summed over those `ref` does not vary over (a k shared by devices that hold
    other queries gets each device's share)."""
    x = vary(x, axes)
    extra = tuple(a for a in axes if a not in varying_axes(ref))
    return lax.psum(x, extra) if extra else x


def _axes(*xs) -> tuple[str, ...]:
    return tuple(sorted(set().union(*(varying_axes(x) for x in xs))))


class Documents:
    """The whole sequence on one device, attention kept inside documents: `segments` [B, T]
    (the model's `seq` argument; jaxscale.parallel.context.Ring is the split version)."""

    def __init__(self, segments):
        self.segments = segments

    def positions(self, t: int):
        return jnp.arange(t)

    def attend(self, q, k, v, kernel: str = "einsum"):
        return attend(q, k, v, kernel, self.segments)
