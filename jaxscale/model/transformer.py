"""One causal transformer (Flax NNX) used by every strategy in jaxscale.

Pre-LayerNorm GPT-style blocks: token + learned position embeddings, multi-head causal
self-attention, a 4x GELU MLP, a final LayerNorm and an output head tied to the token
embedding (logits = h @ E^T), so the tiny preset stays close to the lectures' 28,672
parameters.

The L blocks are not L modules: each block parameter is ONE array with a leading `layers`
axis, and the forward pass runs `jax.lax.scan` over it. Pipeline parallelism later shards
that axis across stages (jaxscale.parallel.pipeline); no second model is written. Every parameter carries logical axis
names (`axes` metadata: vocab, embed, heads, head_dim, mlp, layers, position) that a
sharding Plan maps onto mesh axes.

Three choices change how the model computes, never what (each is a static attribute of
the graph and a Plan field): `remat` (what backward recomputes), `attention` (the kernel:
see jaxscale.model.attention) and `unroll` (the layers as one compiled loop body run L times, or
written out L times: a loop compiles once per shape whatever L is; unrolled code lets XLA
schedule and fuse across layers, which GPU recipes prefer).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxscale import garden
from jaxscale.model import attention as attentionlib
from jaxscale.model.config import ModelConfig, ModelConfigError


# --------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------

def _param(init, key, shape, axes, std=None) -> nnx.Param:
    value = init(key, shape) if std is None else std * init(key, shape)
    assert len(axes) == len(shape), (axes, shape)
    return nnx.Param(value, axes=axes)


def _zeros(shape, axes) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, jnp.float32), axes=axes)


def _ones(shape, axes) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, jnp.float32), axes=axes)


class LayerNorm(nnx.Module):
    """LayerNorm parameters with an optional leading layers axis."""

    def __init__(self, d: int, lead: tuple[int, ...] = ()):
        lead_axes = ("layers",) * len(lead)
        self.scale = _ones((*lead, d), (*lead_axes, "embed"))
        self.bias = _zeros((*lead, d), (*lead_axes, "embed"))


# Activation recomputation (remat) for the scan over blocks: which intermediate values of a
# block the forward pass keeps for backward. "full" keeps only each block's input and
# recomputes the block during backward (one extra forward: about +1/3 compute); "matmuls"
# keeps the matrix-multiply outputs and recomputes the cheap elementwise work.
# "selective" (Korthikanti et al. 2022) keeps the projections' outputs and recomputes the
# attention core, whose T x T scores and softmax are most of a block's activations and
# few of its FLOPs: it saves the matmuls without batch dimensions (x @ W) and not the
# batched ones (q k^T, softmax(.) v), and keeps what the block's collectives received.
#
# The outputs of the collectives inside a block (tp's, the cp ring's) carry the name
# COLLECTIVE, so that a policy can keep them (selective does, and ZeRO-3's gathered
# layers): recomputing one means sending it again.
COLLECTIVE = "collective"
_policies = jax.checkpoint_policies
REMAT_POLICIES = {"none": None, "full": _policies.nothing_saveable,
                  "matmuls": _policies.dots_saveable,
                  "selective": _policies.save_from_both_policies(
                      _policies.dots_with_no_batch_dims_saveable,
                      _policies.save_only_these_names(COLLECTIVE))}


def check_compute(remat: str = "none", attention: str = "einsum") -> None:
    """Raise ModelConfigError naming a remat policy or attention kernel that is unknown."""
    if remat not in REMAT_POLICIES:
        raise ModelConfigError(f"unknown remat policy {remat!r}; choose from "
                               f"{', '.join(REMAT_POLICIES)}")
    try:
        attentionlib.check_kernel(attention)
    except attentionlib.KernelError as e:
        raise ModelConfigError(str(e)) from None


class Blocks(nnx.Module):
    """All transformer blocks, every parameter stacked along a leading `layers` axis."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, remat: str = "none",
                 attention: str = "einsum", unroll: bool = False):
        check_compute(remat, attention)
        # static attributes: part of the graphdef, not of the params
        self.remat, self.attention, self.unroll = remat, attention, bool(unroll)
        L, d, h, k, f = cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.d_ff
        normal = jax.nn.initializers.normal(cfg.init_std)
        # GPT-2: scale the projections that write into the residual stream by 1/sqrt(2L)
        residual = jax.nn.initializers.normal(cfg.init_std / math.sqrt(2 * L))
        self.ln1 = LayerNorm(d, (L,))
        self.wq = _param(normal, rngs.params(), (L, d, h, k), ("layers", "embed", "heads", "head_dim"))
        self.wk = _param(normal, rngs.params(), (L, d, h, k), ("layers", "embed", "heads", "head_dim"))
        self.wv = _param(normal, rngs.params(), (L, d, h, k), ("layers", "embed", "heads", "head_dim"))
        self.bq = _zeros((L, h, k), ("layers", "heads", "head_dim"))
        self.bk = _zeros((L, h, k), ("layers", "heads", "head_dim"))
        self.bv = _zeros((L, h, k), ("layers", "heads", "head_dim"))
        self.wo = _param(residual, rngs.params(), (L, h, k, d), ("layers", "heads", "head_dim", "embed"))
        self.bo = _zeros((L, d), ("layers", "embed"))
        self.ln2 = LayerNorm(d, (L,))
        self.w1 = _param(normal, rngs.params(), (L, d, f), ("layers", "embed", "mlp"))
        self.b1 = _zeros((L, f), ("layers", "mlp"))
        self.w2 = _param(residual, rngs.params(), (L, f, d), ("layers", "mlp", "embed"))
        self.b2 = _zeros((L, d), ("layers", "embed"))


class Transformer(nnx.Module):
    """Causal language model: token ids [B, T] -> logits [B, T, vocab]."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, remat: str = "none",
                 attention: str = "einsum", unroll: bool = False):
        self.cfg = cfg
        normal = jax.nn.initializers.normal(cfg.init_std)
        self.tok_embed = _param(normal, rngs.params(), (cfg.vocab_size, cfg.d_model), ("vocab", "embed"))
        self.pos_embed = _param(normal, rngs.params(), (cfg.seq_len, cfg.d_model), ("position", "embed"))
        self.blocks = Blocks(cfg, rngs, remat, attention, unroll)
        self.ln_f = LayerNorm(cfg.d_model)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        t = tokens.shape[-1]
        if t > self.cfg.seq_len:
            raise ModelConfigError(f"sequence of {t} tokens exceeds seq_len={self.cfg.seq_len}")
        b = self.blocks
        return forward(nnx.to_pure_dict(nnx.state(self, nnx.Param)), tokens, b.remat,
                       attention=b.attention, unroll=b.unroll, seq=sequence(self.cfg, tokens))


def document_ids(tokens: jax.Array) -> jax.Array:
    """Each token's document within its row, [B, T] int32: a document starts at <bos>."""
    return jnp.cumsum(tokens == garden.BOS_ID, axis=-1, dtype=jnp.int32)


def sequence(cfg: ModelConfig, tokens: jax.Array):
    """The `seq` argument of `forward` for whole rows on one device: documents masked
    (attention.Documents) if the model says so, else None (plain causal attention)."""
    return attentionlib.Documents(document_ids(tokens)) if cfg.document_mask else None


def forward(params: dict, tokens: jax.Array, remat: str = "none",
            tp_axis: str | None = None, *, attention: str = "einsum",
            unroll: bool = False, seq=None) -> jax.Array:
    """The model as a pure function of its parameters (a nested dict): token ids -> logits.

    Three units run in turn: `embed` (token + position embeddings), the L blocks (`layers`:
    one `lax.scan` over the stacked layer parameters) and `head` (final LayerNorm, then the
    tied output projection logits = h @ E^T). `tp_axis`: the blocks run tensor parallel
    over that mesh axis (see `block`). ZeRO-3 runs the same units on gathered slices
    (jaxscale.parallel.zero.forward_gathered), a pipeline one stage's layers at a time.
    `seq` says where the tokens sit and how attention sees them: None (whole rows, causal),
    attention.Documents (whole rows, within documents) or parallel.context.Ring (this
    device's share of the sequence; attention is a ring over the cp axis).
    """
    x = layers(params["blocks"], embed(params, tokens, seq), remat, tp_axis,
               attention=attention, unroll=unroll, seq=seq)
    return head(params, x)


def embed(p, tokens, seq=None):
    """Token + learned position embeddings: [B, T] ids -> [B, T, d] (the positions: `seq`'s,
    else 0..T-1)."""
    t = tokens.shape[-1]
    pos = p["pos_embed"][:t] if seq is None else p["pos_embed"][seq.positions(t)]
    return p["tok_embed"][tokens] + pos


def layers(blocks, x, remat: str = "none", tp_axis: str | None = None, *,
           attention: str = "einsum", unroll: bool = False, seq=None):
    """Run a stack of blocks (leading layers axis) over x with `lax.scan`: all of the
    model's layers, or one pipeline stage's share of them. `unroll` writes the L layers
    out one after another (scan's unroll=True: no loop left in the program)."""
    def layer(h, p):
        return block(p, h, tp_axis, attention, seq), None
    if remat != "none":
        layer = jax.checkpoint(layer, policy=REMAT_POLICIES[remat])
    return jax.lax.scan(layer, x, blocks, unroll=True if unroll else 1)[0]


def head(p, x):
    """Final LayerNorm, then the output projection tied to the token embedding."""
    x = layer_norm(x, p["ln_f"]["scale"], p["ln_f"]["bias"])
    return jnp.einsum("btd,vd->btv", x, p["tok_embed"])


# --------------------------------------------------------------------------------------
# The block as pure functions of one layer's parameters (a dict of arrays)
# --------------------------------------------------------------------------------------

def layer_norm(x, scale, bias, eps: float = 1e-5):
    """LayerNorm, computed in float32 whatever x's dtype (mixed precision keeps norms in
    fp32: in float16 the backward of rsqrt(var) overflows once var < ~6e-4)."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps) * scale + bias
    return y.astype(x.dtype)


def _same(x):
    return x


def attention(p, x, reduce=_same, kernel: str = "einsum", seq=None):
    """Multi-head causal self-attention; heads are independent until the output projection.
    `reduce` sums the heads' partial outputs over devices when they are split (tensor
    parallelism); the output bias is added once, after it. `kernel`: jaxscale.model.attention;
    `seq`: see `forward` (it brings its own attend)."""
    q = jnp.einsum("btd,dhk->bthk", x, p["wq"]) + p["bq"]
    k = jnp.einsum("btd,dhk->bthk", x, p["wk"]) + p["bk"]
    v = jnp.einsum("btd,dhk->bthk", x, p["wv"]) + p["bv"]
    out = (attentionlib.attend if seq is None else seq.attend)(q, k, v, kernel)
    return reduce(jnp.einsum("bthk,hkd->btd", out, p["wo"])) + p["bo"]


def mlp(p, x, reduce=_same):
    """GELU MLP; `reduce` as in attention (W1 split by columns, W2 by rows: one sum)."""
    return reduce(jax.nn.gelu(x @ p["w1"] + p["b1"]) @ p["w2"]) + p["b2"]


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


def block(p, x, tp_axis: str | None = None, attention_kernel: str = "einsum", seq=None):
    """One pre-LN transformer block: x + attn(LN(x)), then + mlp(LN(.)).

    With `tp_axis` (inside shard_map) `p` holds this device's share of the heads and of the
    MLP's hidden units (Megatron tensor parallelism) and two operators join the shares:
      enter   identity forward; in backward the all-reduce of the input's gradient (each
              device's heads contribute part of it). Written as pcast-to-varying, whose
              transpose is psum; once per sub-layer, not once per matmul.
      reduce  psum forward: the all-reduce of the partial outputs.
    Two all-reduces per layer forward (attention, MLP) and two backward.

    Sequence parallelism (Korthikanti et al. 2022; `seq.sequence_parallel`): x holds this
    device's T/tp of the sequence, so the LayerNorms, residual adds and dropout-free
    elementwise work between sub-layers are split too, not repeated tp times. Each
    all-reduce becomes its two halves: enter = all-gather of the sequence (backward: a
    reduce-scatter), reduce = reduce-scatter of the partial outputs (backward: an
    all-gather). The same bytes as the all-reduce; activations between sub-layers 1/tp.
    """
    enter, reduce = tp_operators(tp_axis, getattr(seq, "sequence_parallel", False))
    h = enter(layer_norm(x, p["ln1"]["scale"], p["ln1"]["bias"]))
    x = x + attention(p, h, reduce, attention_kernel, seq)
    return x + mlp(p, enter(layer_norm(x, p["ln2"]["scale"], p["ln2"]["bias"])), reduce)


# --------------------------------------------------------------------------------------
# Construction helpers
# --------------------------------------------------------------------------------------

def build(cfg: ModelConfig, seed: int = 0, remat: str = "none", **compute) -> Transformer:
    """A freshly initialised model (deterministic in `seed`); `compute`: attention, unroll."""
    return Transformer(cfg, rngs=nnx.Rngs(params=seed), remat=remat, **compute)


def abstract(cfg: ModelConfig, remat: str = "none", **compute):
    """The model's parameter shapes and dtypes without allocating them (for big presets)."""
    return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=0), remat=remat,
                                              **compute))


def count_params(model: Transformer) -> int:
    """Number of parameters actually in the model (works on abstract models too)."""
    return sum(math.prod(v.shape) for v in jax.tree.leaves(nnx.state(model, nnx.Param)))


def logical_axes(model: Transformer) -> dict:
    """Nested dict, shaped like the parameters, of each parameter's logical axis names."""
    axes = jax.tree.map(lambda v: v.get_metadata("axes"), nnx.state(model, nnx.Param),
                        is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.to_pure_dict(axes)
