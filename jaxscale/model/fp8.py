"""FP8 matrix multiplies with current scaling: the `fp8` and `fp8-block` precision policies.

An 8-bit float holds few values: E4M3 (4 exponent bits, 3 mantissa bits) reaches 448 with
steps of 1/8 near 1, E5M2 reaches 57,344 with steps of 1/4. So a tensor is scaled into
the format's range before the cast, and the product is scaled back:

    s_x = 448 / amax(x)            x8 = cast_e4m3(clip(x * s_x))          (likewise W)
    y   = (x8 @ W8) / (s_x s_W)    accumulated in fp32, returned in the compute dtype

with amax(x) = max |x| over this step's tensor ("current" scaling). `fp8-delayed`
(Transformer Engine's recipe) takes the largest amax of the last H steps instead (training
state: jaxscale.model.fp8_history), so the scale is known before the tensor is, and a value
beyond the history's range saturates at the format's largest. One large value then
sets the scale of the whole tensor, and the rest may fall below E4M3's smallest steps:
`fp8-block` (DeepSeek-V3's fine-grained recipe) keeps a scale per tile instead, 1 x 128
along the contracted axis for activations and gradients, 128 x 128 for weights (`blocks`),
so an outlier costs only its own tile. Forward operands are
E4M3 (precision), gradients E5M2 (range): backward quantises dy the same way and computes
dx = dy8 @ W8^T and dW = x8^T @ dy8 from the FP8 copies the forward kept. Those copies are
what the product saves for backward, but not all a block saves: where another operation
needs the bf16 value too (the norm's backward, the attention kernel), it stays as well.
Measured with `jaxscale explain` on small (dp=2, 4 rows a device): a layer keeps 7.43 MB
under fp8 against 6.97 MB under bf16; the FP8 win here is the arithmetic, not the memory.

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
converts to float8_e4m3fn / float8_e5m2 and back, and multiplies the dequantised operands in
fp32. On an H100 or H200 XLA can rewrite the per-tensor pattern (convert, scale, dot) into
an FP8 GEMM (cuBLASLt); what it does not rewrite runs as that fp32 product, and fp8-block's
per-tile scales are never rewritten: it is an emulation on every platform, as
DeepSeek-V3's recipe needs its own kernels. With a scale per tile E4M3's range suffices,
so fp8-block keeps gradients in E4M3 too, as DeepSeek-V3 does.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from jaxscale.model import fp8_watch
from jaxscale.runtime.vma import vary, varying_axes

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
LARGEST = {E4M3: 448.0, E5M2: 57344.0}
# the mesh axis that splits one tensor's elements within a sample: the amax is a max over it
# where the value varies over it (dp and cp split rows and tokens, which each device scales
# on its own, current scaling; pp splits the layer stack)
SPLIT = ("tp",)
RECIPES = ("native", "fp8", "fp8-delayed", "fp8-block")
BLOCK = 128  # fp8-block's tile: DeepSeek-V3's 1 x 128 activations, 128 x 128 weights


def _varying(x) -> tuple[str, ...]:
    """The SPLIT axes x varies over inside shard_map (none outside it)."""
    return tuple(a for a in SPLIT if a in varying_axes(x))


def amax(x) -> jax.Array:
    """max |x| over the whole tensor, all devices that hold a piece of it (fp32)."""
    local = jnp.max(jnp.abs(x)).astype(jnp.float32)
    axes = _varying(x)
    return lax.pmax(local, axes) if axes else local


def quantize(x, fmt, tiles: dict | None = None, kind: str | None = None,
             scale=None) -> tuple[jax.Array, jax.Array]:
    """(x scaled into fmt's range and cast to it, the scale): x ~ q / scale. One scale for
    the tensor, or with `tiles` ({axis: tile length}) one per tile (`blocks`). A zero tensor
    or tile keeps scale 1; values beyond the range after rounding saturate at +-LARGEST.
    `kind` (one of fp8_watch.KINDS) names the tensor to a watcher (fp8_watch.watching).
    `scale`: one given scale (the delayed recipe's) instead of the tensor's own."""
    if tiles:
        shape, keep = _tiled(x.shape, tiles)
        x32 = x.astype(jnp.float32).reshape(shape)
        a = jnp.max(jnp.abs(x32), axis=keep, keepdims=True)  # per tile, on this device
    else:
        x32 = x.astype(jnp.float32)
        a = amax(x) if scale is None else None
    if scale is None:
        scale = scale_for(a, fmt)
    s = x32 * scale  # what is cast (`scaled`), and what a watcher counts
    q = jnp.clip(s, -LARGEST[fmt], LARGEST[fmt]).astype(fmt)
    if kind is not None:
        fp8_watch.observe(kind, x, s, q, fmt)
    return q.reshape(x.shape), scale


def scale_for(a, fmt) -> jax.Array:
    """The scale that maps an amax `a` onto fmt's largest value (1 where a is 0)."""
    return jnp.where(a > 0, LARGEST[fmt] / jnp.maximum(a, 1e-30), 1.0)


def dequantize(q, scale, tiles: dict | None = None) -> jax.Array:
    """q / scale in fp32, for one scale or one per tile (the `tiles` q was quantized with)."""
    if not tiles:
        return q.astype(jnp.float32) / scale
    return (q.astype(jnp.float32).reshape(_tiled(q.shape, tiles)[0]) / scale).reshape(q.shape)


def scaled(x, scale, tiles: dict | None = None) -> jax.Array:
    """x times its scale (one, or one per tile) in fp32: what `quantize` casts."""
    if not tiles:
        return x.astype(jnp.float32) * scale
    return (x.astype(jnp.float32).reshape(_tiled(x.shape, tiles)[0]) * scale).reshape(x.shape)


def _tiled(shape, tiles: dict) -> tuple[tuple, tuple]:
    """`shape` with each tiled axis split into (tiles, tile length), and the positions of
    the tile-length axes (what a tile's amax reduces over)."""
    out, keep = [], []
    for axis, n in enumerate(shape):
        if axis in tiles:
            out += [n // tiles[axis], tiles[axis]]
            keep.append(len(out) - 1)
        else:
            out.append(n)
    return tuple(out), tuple(keep)


def blocks(spec: str, shapes, block: int) -> tuple[dict, dict, dict]:
    """The tiles of `fp8-block` (DeepSeek-V3's recipe) for einsum `spec` on operands of
    `shapes`: the activation in 1 x block tiles along its last contracted axis, the weight
    in block x block tiles (that same contracted axis by its last output axis: a weight's
    scale never changes inside an activation tile), the incoming gradient in 1 x block
    tiles along its last axis. A dimension shorter than the block is
    one tile; a longer one must be a multiple of it (ValueError naming the operand)."""
    ins, out = spec.split("->")
    a, b = ins.split(",")
    contracted = [c for c in a if c in b and c not in out]
    wanted = ({a.index(contracted[-1])},
              {b.index(contracted[-1]), max(i for i, c in enumerate(b) if c in out)},
              {len(out) - 1})
    operand_shapes = (shapes[0], shapes[1], _out_shape(spec, *shapes))
    return tuple(_fit(name, shape, axes, block) for name, shape, axes in
                 zip(("activation", "weight", "gradient"), operand_shapes, wanted))


def _out_shape(spec, sa, sb) -> tuple:
    ins, out = spec.split("->")
    size = dict(zip(ins.split(",")[0], sa)) | dict(zip(ins.split(",")[1], sb))
    return tuple(size[c] for c in out)


def _fit(name: str, shape, axes, block: int) -> dict:
    tiles = {}
    for axis in sorted(axes):
        n = shape[axis]
        if n > block and n % block:
            raise ValueError(f"fp8-block: the {name}'s axis {axis} of {n} (shape "
                             f"{tuple(shape)}) is not a multiple of the block of {block}")
        tiles[axis] = min(n, block)
    return tiles


def check_tiles(dims: dict[str, int], block: int = BLOCK) -> None:
    """ValueError naming the first of a model's `dims` (name: length on one device) that
    fp8-block cannot tile, longer than the block and not a multiple of it, and the tile
    lengths (powers of two, 16 to 256) that fit every one."""
    for name, n in dims.items():
        if n > block and n % block:
            fits = [b for b in (16, 32, 64, 128, 256)
                    if all(m <= b or m % b == 0 for m in dims.values())]
            raise ValueError(f"fp8-block tiles by {block}: {name} = {n} is not a multiple of "
                             f"it (a dimension shorter than the block is one tile); tiles "
                             f"that fit: {', '.join(map(str, fits)) or 'none of 16 to 256'}")


def einsum(spec: str, a, b, block: int = 0, history=None):
    """jnp.einsum(spec, a, b) with both operands in E4M3 and the incoming gradient in E5M2
    (module docstring); a and b: activations and weights in the compute dtype. `block` > 0:
    scales per tile (`blocks`) instead of per tensor. (`history`: fp8-delayed's, unused.)"""
    return _einsum(spec, jnp.dtype(a.dtype), jnp.dtype(b.dtype), block, a, b)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _einsum(spec, a_dtype, b_dtype, block, a, b):
    return _forward(spec, a_dtype, b_dtype, block, a, b)[0]


def _forward(spec, a_dtype, b_dtype, block, a, b):
    ta, tb, _ = blocks(spec, (a.shape, b.shape), block) if block else (None, None, None)
    (a8, sa), (b8, sb) = quantize(a, E4M3, ta, "activations"), quantize(b, E4M3, tb, "weights")
    # accumulated in fp32 by XLA, returned (and kept by a remat policy) in the compute dtype
    y = jnp.einsum(spec, dequantize(a8, sa, ta), dequantize(b8, sb, tb),
                   preferred_element_type=a_dtype)
    return y, (a8, sa, b8, sb)


def _backward(spec, a_dtype, b_dtype, block, saved, dy):
    a8, sa, b8, sb = saved
    ta, tb, tg = blocks(spec, (a8.shape, b8.shape), block) if block else (None,) * 3
    # per tile, E4M3 has the range the gradients need
    g8, sg = quantize(dy, E4M3 if block else E5M2, tg, "gradients")
    _, pull = jax.vjp(lambda a, b: jnp.einsum(spec, a, b,
                                              preferred_element_type=jnp.float32),
                      dequantize(a8, sa, ta), dequantize(b8, sb, tb))
    da, db = pull(dequantize(g8, sg, tg))
    return _like(da, a8, a_dtype), _like(db, b8, b_dtype)


def _like(grad, primal, dtype):
    """A cotangent as its primal is: its dtype, and summed over the devices it varies over
    but the primal does not (what autodiff does for a value used on every device)."""
    extra = tuple(sorted(varying_axes(grad) - varying_axes(primal)))
    return (lax.psum(grad, extra) if extra else grad).astype(dtype)


_einsum.defvjp(_forward, _backward)


# --------------------------------------------------------------------------------------
# fp8-delayed: the scales from a history of amaxes (Transformer Engine's recipe)
# --------------------------------------------------------------------------------------
# A product's history is [3, H], a row per operand, the newest step in column 0; it reports
# this step's amaxes as the history's cotangent, in column 0: how a value computed in
# backward (the gradient's amax) leaves autodiff (jaxscale.model.fp8_history).
ROWS = ("activation", "weight", "gradient")


def delayed_scale(history, current, fmt) -> jax.Array:
    """The delayed recipe's scale: from the largest amax of the history's row; a history
    that has seen nothing (all zeros: the first step, or a forward run without one) takes
    this step's amax `current` (current scaling)."""
    seen = jnp.max(history)
    return scale_for(jnp.where(seen > 0, seen, current), fmt)


def delayed_einsum(spec: str, a, b, history=None):
    """`einsum` with per-tensor scales from the amax `history` [3, H] (see ROWS); without
    one, current scaling (the `fp8` recipe)."""
    if history is None:
        return einsum(spec, a, b)
    return _delayed(spec, jnp.dtype(a.dtype), jnp.dtype(b.dtype), a, b, history)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _delayed(spec, a_dtype, b_dtype, a, b, history):
    return _delayed_forward(spec, a_dtype, b_dtype, a, b, history)[0]


def _delayed_forward(spec, a_dtype, b_dtype, a, b, history):
    seen = jnp.stack([amax(a), amax(b)])  # this step's, for the history
    a8, sa = quantize(a, E4M3, kind="activations",
                      scale=delayed_scale(history[0], seen[0], E4M3))
    b8, sb = quantize(b, E4M3, kind="weights", scale=delayed_scale(history[1], seen[1], E4M3))
    y = jnp.einsum(spec, dequantize(a8, sa), dequantize(b8, sb), preferred_element_type=a_dtype)
    return y, (a8, sa, b8, sb, seen, history)


def _delayed_backward(spec, a_dtype, b_dtype, saved, dy):
    a8, sa, b8, sb, seen, history = saved
    g = amax(dy)
    g8, sg = quantize(dy, E5M2, kind="gradients", scale=delayed_scale(history[2], g, E5M2))
    _, pull = jax.vjp(lambda a, b: jnp.einsum(spec, a, b, preferred_element_type=jnp.float32),
                      dequantize(a8, sa), dequantize(b8, sb))
    da, db = pull(dequantize(g8, sg))
    amaxes = jnp.concatenate([seen, g[None]])[:, None]  # column 0, zeros after it
    reported = jnp.pad(amaxes, ((0, 0), (0, history.shape[1] - 1)))
    return _like(da, a8, a_dtype), _like(db, b8, b_dtype), _as_history(reported, history)


def _as_history(reported, history):
    """The reported amaxes varying exactly as the history does: a max over devices it does
    not vary over (every device of a split scales alike, so this is their common value)."""
    extra = tuple(sorted(varying_axes(reported) - varying_axes(history)))
    reported = lax.pmax(reported, extra) if extra else reported
    return vary(reported, tuple(sorted(varying_axes(history))))


_delayed.defvjp(_delayed_forward, _delayed_backward)


def _native(spec, a, b, history=None):  # (a history is fp8-delayed's only)
    return jnp.einsum(spec, a, b)


def matmul(recipe: str, block: int = BLOCK):
    """The einsum a block multiplies with under `recipe`, called (spec, a, b, history=None):
    jnp.einsum ("native"), the FP8 one with a scale per tensor ("fp8"), per tile of `block`
    ("fp8-block"), or per tensor from the product's amax `history` ("fp8-delayed")."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown matmul recipe {recipe!r}; choose from {', '.join(RECIPES)}")
    if recipe == "fp8-block" and (not isinstance(block, int) or block < 1):
        raise ValueError(f"fp8-block's tile must be a positive integer, got {block!r}")
    if recipe == "native":
        return _native
    if recipe == "fp8-delayed":
        return delayed_einsum
    return partial(einsum, block=block if recipe == "fp8-block" else 0)
