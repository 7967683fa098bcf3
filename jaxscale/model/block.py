"""One transformer block as pure functions of one layer's parameters (a dict of arrays).

The same functions compute both families (jaxscale.model.config.Family): GPT-2's block
(LayerNorm with a bias, biases on every projection, a GELU MLP, positions already added to
the input) and Llama's (RMSNorm, no biases, a SwiGLU MLP, rotary positions applied to q
and k, fewer k/v heads than query heads). Which biases exist is read from the parameters
(a model built without them has none); everything else from the family.

Tensor parallelism runs these functions inside shard_map on each device's share of the
heads and of the MLP's hidden units (`block`'s docstring); nothing here knows how many
devices there are except grouped-query attention when tp does not divide the k/v heads
(`local_kv`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jaxscale.model import attention as attentionlib, fp8, fp8_history, mla, moe, rope
from jaxscale.model.norms import layer_norm, norm, rms_norm  # noqa: F401 (the block's own names)
from jaxscale.model.config import GPT2, Family
from jaxscale.runtime.vma import COLLECTIVE  # (a remat policy may keep what carries it)


def _same(x):
    return x


def _plus_bias(y, p, name):
    return y + p[name] if name in p else y


def positions(seq, t: int):
    """The positions of the t tokens x holds: `seq`'s (a device's share of the sequence,
    or whole rows), else 0..t-1."""
    return jnp.arange(t) if seq is None else seq.positions(t)


def local_kv(k, v, q_heads: int, family: Family, tp_axis: str | None):
    """k and v [B, T, kv, K] as this device's query heads need them. With tp splitting the
    k/v heads as it splits the query heads (tp divides both) a device's query heads use
    exactly its own k/v heads, and attention repeats each for its group. When tp does not
    divide the k/v heads (tp > kv_heads, say) they stay whole on every device (the layout
    replicates them) and each device picks, for each of its query heads, the k/v head that
    head reads: head j of h reads k/v head j // (h / kv_heads)."""
    kv = family.kv_heads
    if tp_axis is None or not kv or kv % lax.axis_size(tp_axis) == 0:
        return k, v
    tp = lax.axis_size(tp_axis)
    group = q_heads * tp // kv
    mine = (lax.axis_index(tp_axis) * q_heads + jnp.arange(q_heads)) // group
    return jnp.take(k, mine, axis=2), jnp.take(v, mine, axis=2)


def attention(p, x, reduce=_same, kernel: str = "einsum", seq=None, family: Family = GPT2,
              tp_axis: str | None = None):
    """Causal self-attention; heads are independent until the output projection. `reduce`
    sums the heads' partial outputs over devices when they are split (tensor parallelism);
    the output bias is added once, after it. `kernel`: jaxscale.model.attention; `seq`: see
    jaxscale.model.transformer.forward (it brings its own attend). With rotary positions q
    and k turn by their tokens' positions before anything else sees them; k and v may have
    fewer heads than q (grouped-query attention: the kernels repeat them). A block with
    latent attention (p[mla.LATENT]) computes it instead (jaxscale.model.mla)."""
    if mla.LATENT in p:
        return mla.attention(p[mla.LATENT], p["wo"], x, positions(seq, x.shape[1]), reduce,
                             kernel, seq, family)
    dot = products(p, family)
    q = _plus_bias(dot("btd,dhk->bthk", x, "wq"), p, "bq")
    k = _plus_bias(dot("btd,dhk->bthk", x, "wk"), p, "bk")
    v = _plus_bias(dot("btd,dhk->bthk", x, "wv"), p, "bv")
    if family.position == "rope":
        where = positions(seq, x.shape[1])
        q = rope.rotate(q, where, family.rope_theta, family.rope_scaling)
        k = rope.rotate(k, where, family.rope_theta, family.rope_scaling)
    k, v = local_kv(k, v, q.shape[2], family, tp_axis)
    out = (attentionlib.attend if seq is None else seq.attend)(q, k, v, kernel)
    return _plus_bias(reduce(dot("bthk,hkd->btd", out, "wo")), p, "bo")


def mlp(p, x, reduce=_same, family: Family = GPT2):
    """The MLP; `reduce` as in attention (W1, W3 split by columns, W2 by rows: one sum).
    GELU: gelu(x W1 + b1) W2 + b2. SwiGLU (Shazeer 2020): (silu(x W1) * (x W3)) W2, a gate
    and a value from two matrices."""
    if ("w3" in p) != (family.mlp == "swiglu"):
        raise ValueError(f"the parameters {'have' if 'w3' in p else 'lack'} W3 but the "
                         f"family's MLP is {family.mlp!r}: pass the model's family")
    dot = products(p, family)
    up = _plus_bias(dot("btd,df->btf", x, "w1"), p, "b1")
    if family.mlp == "swiglu":
        hidden = jax.nn.silu(up) * _plus_bias(dot("btd,df->btf", x, "w3"), p, "b3")
    else:
        hidden = jax.nn.gelu(up)
    return _plus_bias(reduce(dot("btf,fd->btd", hidden, "w2")), p, "b2")


def products(p, family: Family = GPT2):
    """dot(spec, x, name): x times the layer's weight p[name] under the family's matmul
    recipe, with the product's amax history where the layer carries one (fp8-delayed:
    jaxscale.model.fp8_history.attach)."""
    dot = fp8.matmul(family.matmul, family.fp8_block)
    seen = p.get(fp8_history.BLOCKS, {})
    return lambda spec, x, name: dot(spec, x, p[name], history=seen.get(name))


def tp_operators(tp_axis: str | None, sequence_parallel: bool = False):
    """(enter, reduce) joining tensor-parallel shares over `tp_axis` (see `block`); both the
    identity without an axis."""
    if tp_axis is None:
        return _same, _same
    named = lambda x: checkpoint_name(x, COLLECTIVE)  # noqa: E731
    if sequence_parallel:  # activations [B, T/tp, d] outside the sub-layers, [B, T, d] in
        return (lambda h: named(jax.lax.all_gather(h, tp_axis, axis=1, tiled=True)),
                lambda y: named(jax.lax.psum_scatter(y, tp_axis, scatter_dimension=1,
                                                     tiled=True)))
    return (lambda h: jax.lax.pcast(h, tp_axis, to="varying"),
            lambda y: named(jax.lax.psum(y, tp_axis)))


def block(p, x, tp_axis: str | None = None, attention_kernel: str = "einsum", seq=None,
          family: Family = GPT2):
    """One pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(.)); see
    `block_with_stats`."""
    return block_with_stats(p, x, tp_axis, attention_kernel, seq, family)[0]


def block_with_stats(p, x, tp_axis: str | None = None, attention_kernel: str = "einsum",
                     seq=None, family: Family = GPT2):
    """One pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(.)); returns
    (x, the router's statistics): a block with experts in the MLP's place (p["experts"],
    jaxscale.model.moe) routes each token to its own; a dense block's statistics are {}.

    With `tp_axis` (inside shard_map) `p` holds this device's share of the heads and of the
    MLP's hidden units (Megatron tensor parallelism) and two operators join the shares:
      enter   identity forward; in backward the all-reduce of the input's gradient (each
              device's heads contribute part of it). Written as pcast-to-varying, whose
              transpose is psum; once per sub-layer, not once per matmul.
      reduce  psum forward: the all-reduce of the partial outputs.
    Two all-reduces per layer forward (attention, MLP) and two backward.

    Sequence parallelism (Korthikanti et al. 2022; `seq.sequence_parallel`): x holds this
    device's T/tp of the sequence, so the norms, residual adds and dropout-free
    elementwise work between sub-layers are split too, not repeated tp times. Each
    all-reduce becomes its two halves: enter = all-gather of the sequence (backward: a
    reduce-scatter), reduce = reduce-scatter of the partial outputs (backward: an
    all-gather). The same bytes as the all-reduce; activations between sub-layers 1/tp.
    """
    enter, reduce = tp_operators(tp_axis, getattr(seq, "sequence_parallel", False))
    h = enter(norm(x, p["ln1"], family))
    x = x + attention(p, h, reduce, attention_kernel, seq, family, tp_axis)
    h = enter(norm(x, p["ln2"], family))
    if "experts" in p:
        y, stats = moe.layer(p["experts"], h, reduce, family)
        return x + y, stats
    return x + mlp(p, h, reduce, family), {}
