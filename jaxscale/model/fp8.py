"""FP8 matrix multiplies with per-tensor current scaling: the `fp8` precision policy.

An 8-bit float holds few values: E4M3 (4 exponent bits, 3 mantissa bits) reaches 448 with
steps of 1/8 near 1, E5M2 reaches 57,344 with steps of 1/4. So a tensor is scaled into
the format's range before the cast, and the product is scaled back:

    s_x = 448 / amax(x)            x8 = cast_e4m3(clip(x * s_x))          (likewise W)
    y   = (x8 @ W8) / (s_x s_W)    accumulated in fp32, returned in the compute dtype

with amax(x) = max |x| over this step's tensor ("current" scaling; Transformer Engine's
delayed scaling takes it from a history of earlier steps instead). Forward operands are
E4M3 (precision), gradients E5M2 (range): backward quantises dy the same way and computes
dx = dy8 @ W8^T and dW = x8^T @ dy8 from the FP8 copies the forward kept, which are what
the layer saves for backward (one byte per element instead of two).

Where a layout splits one tensor's elements over devices (tp: a weight's heads or units, an
activation's heads), every device of the split must scale it alike, or the devices would
compute pieces of different tensors: the amax is a max over those devices (`SPLIT`: the tp
axis, where the value varies over it). Rows and tokens are another matter: dp's and cp's
devices scale their own rows and tokens, as one device scales each micro-batch of an
accumulated step on its own (compare's control run measures exactly that difference).
That is also what keeps the program runnable on XLA:CPU, whose runtime aborts when two
all-reduces are in flight at once on a device ("id < num_threads"): a max over dp for every
activation and gradient puts several in flight (the backward's dq, dk and dv at least).

On a CPU the casts and products are computed for real (the numerics, not the speed): XLA
converts to float8_e4m3fn / float8_e5m2 and back. On an H100 or H200 XLA rewrites this
dequantise-then-dot pattern into an FP8 GEMM (cuBLASLt) where it supports it.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
LARGEST = {E4M3: 448.0, E5M2: 57344.0}
# the mesh axis that splits one tensor's elements within a sample (jaxscale.parallel.axes
# names it): the amax is a max over it where the value varies over it (dp and cp split rows
# and tokens, which each device scales on its own; pp splits the layer stack)
SPLIT = ("tp",)
RECIPES = ("native", "fp8")


def _varying(x) -> tuple[str, ...]:
    """The SPLIT axes x varies over inside shard_map (none outside it)."""
    return tuple(a for a in SPLIT if a in _all_varying(x))


def amax(x) -> jax.Array:
    """max |x| over the whole tensor, all devices that hold a piece of it (fp32)."""
    local = jnp.max(jnp.abs(x)).astype(jnp.float32)
    axes = _varying(x)
    return lax.pmax(local, axes) if axes else local


def quantize(x, fmt) -> tuple[jax.Array, jax.Array]:
    """(x scaled into fmt's range and cast to it, the scale): x ~ q / scale. A zero tensor
    keeps scale 1; values beyond the range after rounding saturate at +-LARGEST."""
    a = amax(x)
    scale = jnp.where(a > 0, LARGEST[fmt] / jnp.maximum(a, 1e-30), 1.0)
    scaled = jnp.clip(x.astype(jnp.float32) * scale, -LARGEST[fmt], LARGEST[fmt])
    return scaled.astype(fmt), scale


def _product(spec, a8, sa, b8, sb, dtype):
    """The einsum of two scaled FP8 operands, accumulated in fp32, rescaled, in `dtype`."""
    y = jnp.einsum(spec, a8.astype(jnp.float32), b8.astype(jnp.float32),
                   preferred_element_type=jnp.float32)
    return (y / (sa * sb)).astype(dtype)


def einsum(spec: str, a, b):
    """jnp.einsum(spec, a, b) with both operands in E4M3 and the incoming gradient in E5M2
    (module docstring); a and b: activations and weights in the compute dtype."""
    return _einsum(spec, jnp.dtype(a.dtype), jnp.dtype(b.dtype), a, b)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _einsum(spec, a_dtype, b_dtype, a, b):
    return _forward(spec, a_dtype, b_dtype, a, b)[0]


def _forward(spec, a_dtype, b_dtype, a, b):
    (a8, sa), (b8, sb) = quantize(a, E4M3), quantize(b, E4M3)
    return _product(spec, a8, sa, b8, sb, a_dtype), (a8, sa, b8, sb)


def _backward(spec, a_dtype, b_dtype, saved, dy):
    a8, sa, b8, sb = saved
    g8, sg = quantize(dy, E5M2)
    a, b = a8.astype(jnp.float32) / sa, b8.astype(jnp.float32) / sb
    _, pull = jax.vjp(lambda a, b: jnp.einsum(spec, a, b,
                                              preferred_element_type=jnp.float32), a, b)
    da, db = pull(g8.astype(jnp.float32) / sg)
    return _like(da, a8, a_dtype), _like(db, b8, b_dtype)


def _like(grad, primal, dtype):
    """A cotangent as its primal is: its dtype, and summed over the devices it varies over
    but the primal does not (what autodiff does for a value used on every device)."""
    extra = tuple(sorted(_all_varying(grad) - _all_varying(primal)))
    return (lax.psum(grad, extra) if extra else grad).astype(dtype)


def _all_varying(x) -> frozenset:
    aval = jax.typeof(x)
    return frozenset(aval.manual_axis_type.varying if hasattr(aval, "manual_axis_type")
                     else getattr(aval, "vma", ()))


_einsum.defvjp(_forward, _backward)


def matmul(recipe: str):
    """The einsum a block multiplies with under `recipe`: jnp.einsum ("native") or the
    FP8 one."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown matmul recipe {recipe!r}; choose from {', '.join(RECIPES)}")
    return jnp.einsum if recipe == "native" else einsum
