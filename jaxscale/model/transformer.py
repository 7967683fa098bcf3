"""One causal transformer (Flax NNX) used by every strategy in jaxscale.

Pre-norm blocks of one of two families (jaxscale.model.config): GPT-2's (token + learned
position embeddings, LayerNorms, multi-head attention, a 4x GELU MLP, an output head tied
to the token embedding: logits = h @ E^T, so the tiny preset stays close to the lectures'
28,672 parameters) or Llama's (no position table but rotary positions in attention,
RMSNorms, grouped-query attention, a SwiGLU MLP, no biases, an output head of its own),
with a mixture of experts in the MLP's place (model.moe) and DeepSeek's latent attention
in q, k and v's (model.mla) as options of either.
The block itself is jaxscale.model.block; this module holds the parameters and runs the
units in order.

The L blocks are not L modules: each block parameter is ONE array with a leading `layers`
axis, and the forward pass runs `jax.lax.scan` over it. Pipeline parallelism later shards
that axis across stages (jaxscale.parallel.pipeline); no second model is written. Every parameter carries logical axis
names (`axes` metadata: vocab, embed, heads, kv_heads, head_dim, mlp, layers, position,
experts, and latent attention's q_latent and kv_latent) that a sharding Plan maps onto
mesh axes. (The first_dense blocks' MLP leads with first_dense, not L: model.stack.)

Some choices change how the model computes, never which function it computes (each is a
static attribute of the graph and a Plan field): `remat` (what backward recomputes),
`attention` (the kernel: see jaxscale.model.attention), `unroll` (the layers as one
compiled loop body run L times, or written out L times: a loop compiles once per shape
whatever L is; unrolled code lets XLA schedule and fuse across layers, which GPU recipes
prefer), and `matmul` (how the blocks' projections multiply: natively, or in FP8 under an
fp8 precision policy, jaxscale.model.fp8) with its options `fp8_block` (fp8-block's tile)
and `fp8_head` (the output head under the recipe too).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxscale import garden
from jaxscale.model import attention as attentionlib, fp8, fp8_history, mla, moe, stack
from jaxscale.model.block import (COLLECTIVE, attention, block, block_with_stats,  # noqa: F401
                                  layer_norm, mlp, norm, rms_norm, tp_operators)
from jaxscale.model.config import GPT2, Family, ModelConfig, ModelConfigError
from jaxscale.model.params import LayerNorm, param as _param, zeros as _zeros


# --------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------

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
# COLLECTIVE (jaxscale.model.block), so that a policy can keep them (selective does, and
# ZeRO-3's gathered layers): recomputing one means sending it again.
_policies = jax.checkpoint_policies
REMAT_POLICIES = {"none": None, "full": _policies.nothing_saveable,
                  "matmuls": _policies.dots_saveable,
                  "selective": _policies.save_from_both_policies(
                      _policies.dots_with_no_batch_dims_saveable,
                      _policies.save_only_these_names(COLLECTIVE))}


def check_compute(remat: str = "none", attention: str = "einsum",
                  matmul: str = "native") -> None:
    """Raise ModelConfigError naming a remat policy, attention kernel or matmul recipe that
    is unknown."""
    if matmul not in fp8.RECIPES:
        raise ModelConfigError(f"unknown matmul recipe {matmul!r}; choose from "
                               f"{', '.join(fp8.RECIPES)}")
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
                 attention: str = "einsum", unroll: bool = False, matmul: str = "native",
                 fp8_block: int = fp8.BLOCK, fp8_head: bool = False):
        check_compute(remat, attention, matmul)
        # static attributes: part of the graphdef, not of the params
        self.remat, self.attention, self.unroll = remat, attention, bool(unroll)
        # the FP8 options live with the blocks' matmul recipe (the head's included): the
        # graph's static compute choices all sit here, where Transformer.__call__ reads them
        self.matmul, self.fp8_block, self.fp8_head = matmul, fp8_block, bool(fp8_head)
        L, d, h, k = cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.head_dim
        kv, bias = cfg.kv_heads, cfg.bias
        # k and v: "kv_heads" when fewer than the query heads (tp splits them only if it
        # divides them: jaxscale.parallel.hybrid.param_specs)
        kv_axis = "heads" if kv == h else "kv_heads"
        normal = jax.nn.initializers.normal(cfg.init_std)
        # GPT-2: scale the projections that write into the residual stream by 1/sqrt(2L)
        residual = jax.nn.initializers.normal(cfg.init_std / math.sqrt(2 * L))
        norm_bias = bias and cfg.norm == "layernorm"
        self.ln1 = LayerNorm(d, (L,), norm_bias)
        if cfg.kv_lora_rank:  # latent attention's projections (jaxscale.model.mla)
            self.latent = mla.Latent(cfg, rngs)
        else:
            self.wq = _param(normal, rngs.params(), (L, d, h, k), ("layers", "embed", "heads", "head_dim"))
            self.wk = _param(normal, rngs.params(), (L, d, kv, k), ("layers", "embed", kv_axis, "head_dim"))
            self.wv = _param(normal, rngs.params(), (L, d, kv, k), ("layers", "embed", kv_axis, "head_dim"))
        if bias:
            self.bq = _zeros((L, h, k), ("layers", "heads", "head_dim"))
            self.bk = _zeros((L, kv, k), ("layers", kv_axis, "head_dim"))
            self.bv = _zeros((L, kv, k), ("layers", kv_axis, "head_dim"))
        self.wo = _param(residual, rngs.params(), (L, h, cfg.v_dim, d), ("layers", "heads", "head_dim", "embed"))
        if bias:
            self.bo = _zeros((L, d), ("layers", "embed"))
        self.ln2 = LayerNorm(d, (L,), norm_bias)
        if cfg.n_experts:  # a mixture of experts in the MLP's place (jaxscale.model.moe)
            self.experts = moe.Experts(cfg, rngs)
        if cfg.first_dense:  # DeepSeek's first blocks keep the dense MLP (model.stack)
            self.dense = DenseMLP()
            _dense_mlp(self.dense, cfg, cfg.first_dense, rngs)
        elif cfg.dense_layers:  # the blocks with the dense MLP (all but the experts')
            _dense_mlp(self, cfg, cfg.dense_layers, rngs)


class DenseMLP(nnx.Module):
    """The first blocks' dense MLP, apart from the rest of the stack (first_dense)."""


def _dense_mlp(into: nnx.Module, cfg: ModelConfig, L: int, rngs: nnx.Rngs) -> None:
    """W1, W2 (SwiGLU: W3) and their biases if the model has them, for L blocks."""
    d, f, bias = cfg.d_model, cfg.d_ff, cfg.bias
    normal = jax.nn.initializers.normal(cfg.init_std)
    residual = jax.nn.initializers.normal(cfg.init_std / math.sqrt(2 * cfg.n_layers))
    into.w1 = _param(normal, rngs.params(), (L, d, f), ("layers", "embed", "mlp"))
    if bias:
        into.b1 = _zeros((L, f), ("layers", "mlp"))
    into.w2 = _param(residual, rngs.params(), (L, f, d), ("layers", "mlp", "embed"))
    if bias:
        into.b2 = _zeros((L, d), ("layers", "embed"))
    if cfg.mlp == "swiglu":  # the value half of the gated MLP
        into.w3 = _param(normal, rngs.params(), (L, d, f), ("layers", "embed", "mlp"))
        if bias:
            into.b3 = _zeros((L, f), ("layers", "mlp"))


class Transformer(nnx.Module):
    """Causal language model: token ids [B, T] -> logits [B, T, vocab]."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, remat: str = "none",
                 attention: str = "einsum", unroll: bool = False, matmul: str = "native",
                 fp8_block: int = fp8.BLOCK, fp8_head: bool = False):
        self.cfg = cfg
        normal = jax.nn.initializers.normal(cfg.init_std)
        self.tok_embed = _param(normal, rngs.params(), (cfg.vocab_size, cfg.d_model), ("vocab", "embed"))
        if cfg.position == "learned":
            self.pos_embed = _param(normal, rngs.params(), (cfg.seq_len, cfg.d_model), ("position", "embed"))
        self.blocks = Blocks(cfg, rngs, remat, attention, unroll, matmul, fp8_block, fp8_head)
        self.ln_f = LayerNorm(cfg.d_model, bias=cfg.bias and cfg.norm == "layernorm")
        if not cfg.tied_head:  # logits = h @ U, U [d, vocab] of its own
            self.unembed = _param(normal, rngs.params(), (cfg.d_model, cfg.vocab_size), ("embed", "vocab"))

    def __call__(self, tokens: jax.Array, history=None) -> jax.Array:
        """Logits; `history`: fp8-delayed's amax histories (model.fp8_history), if any."""
        return self.with_stats(tokens, history)[0]

    def with_stats(self, tokens: jax.Array, history=None):
        """(logits, the routers' statistics: jaxscale.model.moe.over_layers; {} if dense)."""
        t = tokens.shape[-1]
        if t > self.cfg.seq_len:
            raise ModelConfigError(f"sequence of {t} tokens exceeds seq_len={self.cfg.seq_len}")
        b = self.blocks
        params = fp8_history.attach(nnx.to_pure_dict(nnx.state(self, nnx.Param)), history)
        return forward_with_stats(params, tokens, b.remat,
                       attention=b.attention, unroll=b.unroll, seq=sequence(self.cfg, tokens),
                       family=dataclasses.replace(self.cfg.family, matmul=b.matmul,
                                                  fp8_block=b.fp8_block, fp8_head=b.fp8_head))


def document_ids(tokens: jax.Array) -> jax.Array:
    """Each token's document within its row, [B, T] int32: a document starts at <bos>."""
    return jnp.cumsum(tokens == garden.BOS_ID, axis=-1, dtype=jnp.int32)


def sequence(cfg: ModelConfig, tokens: jax.Array):
    """The `seq` argument of `forward` for whole rows on one device: documents masked
    (attention.Documents) if the model says so, else None (plain causal attention)."""
    return attentionlib.Documents(document_ids(tokens)) if cfg.document_mask else None


def forward(params: dict, tokens: jax.Array, remat: str = "none",
            tp_axis: str | None = None, *, attention: str = "einsum",
            unroll: bool = False, seq=None, family: Family = GPT2) -> jax.Array:
    """The model as a pure function of its parameters (a nested dict): token ids -> logits.

    Three units run in turn: `embed` (token embeddings, plus learned positions), the L
    blocks (`layers`: one `lax.scan` over the stack, jaxscale.model.stack) and `head`
    (final norm, then the output projection: tied, logits = h @ E^T, or its own).
    `family`: how the blocks compute (the ModelConfig's `.family`, model.family). `tp_axis`:
    the blocks run tensor parallel over that mesh axis. ZeRO-3 runs the units on slices
    (parallel.zero.forward_gathered), a pipeline one stage's layers at a time. `seq`: where
    the tokens sit and how attention sees them: None (whole rows, causal), Documents
    (whole rows, within documents) or parallel.context.Ring (this device's share of the
    sequence; attention is a ring over the cp axis)."""
    return forward_with_stats(params, tokens, remat, tp_axis, attention=attention,
                              unroll=unroll, seq=seq, family=family)[0]


def forward_with_stats(params: dict, tokens: jax.Array, remat: str = "none",
                       tp_axis: str | None = None, *, attention: str = "einsum",
                       unroll: bool = False, seq=None, family: Family = GPT2):
    """(logits, the routers' statistics over the layers: {} if dense): see `forward`."""
    x, stats = layers_with_stats(params["blocks"], embed(params, tokens, seq, family), remat,
                                 tp_axis, attention=attention, unroll=unroll, seq=seq,
                                 family=family)
    return head(params, x, family), stats


def embed(p, tokens, seq=None, family: Family = GPT2):
    """Token embeddings [B, T] ids -> [B, T, d], plus the learned position embeddings if the
    family has them (the positions: `seq`'s, else 0..T-1; rotary positions enter later, in
    attention)."""
    if ("pos_embed" in p) != (family.position == "learned"):
        raise ModelConfigError(f"the parameters {'have' if 'pos_embed' in p else 'lack'} a "
                               f"position table but the family's positions are "
                               f"{family.position!r}: pass the model's family")
    x = p["tok_embed"][tokens]
    if "pos_embed" not in p:
        return x
    t = tokens.shape[-1]
    return x + (p["pos_embed"][:t] if seq is None else p["pos_embed"][seq.positions(t)])


def layers(blocks, x, remat: str = "none", tp_axis: str | None = None, *,
           attention: str = "einsum", unroll: bool = False, seq=None, family: Family = GPT2):
    """Run a stack of blocks (leading layers axis) over x with `lax.scan`: all of the
    model's layers, or one pipeline stage's share of them. `unroll` writes the L layers
    out one after another (scan's unroll=True: no loop left in the program)."""
    return layers_with_stats(blocks, x, remat, tp_axis, attention=attention,
                             unroll=unroll, seq=seq, family=family)[0]


def layers_with_stats(blocks, x, remat: str = "none", tp_axis: str | None = None, *,
                      attention: str = "einsum", unroll: bool = False, seq=None,
                      family: Family = GPT2):
    """(x after the blocks, the routers' statistics over them: {} for dense blocks)."""
    def layer(h, p):
        return block_with_stats(p, h, tp_axis, attention, seq, family)
    if remat != "none":
        layer = jax.checkpoint(layer, policy=REMAT_POLICIES[remat])
    x, stats = stack.scan(layer, x, blocks, unroll=True if unroll else 1)
    return x, moe.over_layers(stats)


def head(p, x, family: Family = GPT2):
    """Final norm, then the output projection: the model's own (`unembed` [d, vocab]) or
    the token embedding's transpose (tied); under the family's FP8 recipe only if it says
    `fp8_head` (the head is the most sensitive product: most recipes keep it in bf16)."""
    x = norm(x, p["ln_f"], family)
    dot = fp8.matmul(family.matmul if family.fp8_head else "native", family.fp8_block)
    seen = p.get(fp8_history.HEAD)  # fp8-delayed's amax history (fp8_history.attach)
    if "unembed" in p:
        return dot("btd,dv->btv", x, p["unembed"], history=seen)
    return dot("btd,vd->btv", x, p["tok_embed"], history=seen)


# --- construction helpers -------------------------------------------------------------

def build(cfg: ModelConfig, seed: int = 0, remat: str = "none", **compute) -> Transformer:
    """A freshly initialised model (deterministic in `seed`); `compute`: attention, unroll,
    matmul, fp8_block, fp8_head (Transformer's static compute choices)."""
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
