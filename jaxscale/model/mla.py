"""Multi-head latent attention (DeepSeek-V2, 2024; DeepSeek-V3 keeps it): attention whose
keys and values come from one narrow latent per token, so that inference caches the
latent (kv_lora_rank + qk_rope_dim numbers per token and layer) instead of every head's
k and v. Training computes the same attention as any other; what changes is the shapes.

For a token x [d] and h heads (ModelConfig's fields, model.config):

    q latent    c_q = rmsnorm(x W_qa)              W_qa [d, q_lora_rank]
    queries     q   = c_q W_qb                     W_qb [q_lora_rank, h, nope + rope]
                (q_lora_rank 0: q = x W_q, W_q [d, h, nope + rope])
    kv latent   [c_kv, k_r] = x W_kva              W_kva [d, kv_lora_rank + rope]
                c_kv = rmsnorm(c_kv)
    keys        k = [c_kv W_kb, rope(k_r)]         W_kb [kv_lora_rank, h, nope]; k_r is one
                                                   rope-wide key that every head shares
    values      v = c_kv W_vb                      W_vb [kv_lora_rank, h, v_head_dim]
    rotation    only q's last `rope` dimensions and k_r turn by position (RoPE); the
                `nope` ones carry no position, which is what lets inference fold W_kb
                into the queries and attend to the cached latent directly
    output      softmax(q k^T / sqrt(nope + rope), causal) v, then Wo [h, v_head_dim, d]

(DeepSeek's checkpoints fuse W_kb and W_vb into one kv_b_proj; they are apart here so
that each weight's shape says what it is. DeepSeek-V3's YaRN scaling of the rotation, for
contexts past 4K, is not implemented.)

Tensor parallelism splits what is per head, as in plain attention: W_qb, W_kb, W_vb by
their heads axis, Wo by its rows. The down-projections W_qa, W_kva and the two latent
norms are replicated: every device computes the same latents from the same x. Their
gradients are partial on each device (each saw only its heads' use of the latent) and
shard_map sums them over tp: an all-reduce of the latent weights' gradients per layer and
micro-batch, in backward, that plain attention does not have (under sequence parallelism
they join the step's reduction instead; compare.predict counts both).

The fused kernels (xla, cudnn) take values as wide as the keys: v is padded with zeros
to nope + rope and the output's padding dropped (exact: zero columns of v give zero
columns of the output).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxscale.model import attention as attentionlib, fp8, rope
from jaxscale.model.config import ModelConfig
from jaxscale.model.family import Family
from jaxscale.model.norms import rms_norm
from jaxscale.model.params import LayerNorm, param

LATENT = "latent"  # a block's entry holding these parameters


class Latent(nnx.Module):
    """One stack's latent-attention projections (every array with a leading layers axis);
    the output projection Wo is the block's own, as in plain attention."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        L, d, h, cq, ck = (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.q_lora_rank,
                           cfg.kv_lora_rank)
        normal = jax.nn.initializers.normal(cfg.init_std)

        def make(shape, axes):
            return param(normal, rngs.params(), (L, *shape), ("layers", *axes))
        if cq:
            self.wq_a = make((d, cq), ("embed", "q_latent"))
            self.q_norm = LayerNorm(cq, (L,), bias=False, axis="q_latent")
            self.wq_b = make((cq, h, cfg.qk_dim), ("q_latent", "heads", "head_dim"))
        else:
            self.wq = make((d, h, cfg.qk_dim), ("embed", "heads", "head_dim"))
        self.wkv_a = make((d, ck + cfg.qk_rope_dim), ("embed", "kv_latent"))
        self.kv_norm = LayerNorm(ck, (L,), bias=False, axis="kv_latent")
        self.wk_b = make((ck, h, cfg.qk_nope_dim), ("kv_latent", "heads", "head_dim"))
        self.wv_b = make((ck, h, cfg.v_head_dim), ("kv_latent", "heads", "head_dim"))


def queries(p, x, family: Family):
    """q [B, T, heads, nope + rope] before rotation, through the q latent if there is one."""
    dot = fp8.matmul(family.matmul, family.fp8_block)
    if "wq" in p:
        return dot("btd,dhk->bthk", x, p["wq"])
    c = rms_norm(dot("btd,dr->btr", x, p["wq_a"]), p["q_norm"]["scale"], family.norm_eps)
    return dot("btr,rhk->bthk", c, p["wq_b"])


def attention(p, wo, x, where, reduce, kernel: str = "einsum", seq=None,
              family: Family = Family()):
    """Causal latent attention of x [B, T, d] at positions `where` [T]: p is a block's
    LATENT entry, wo its output projection [heads, v_head_dim, d]; `reduce` sums the heads'
    partial outputs over tp (model.block.attention's), `seq` brings its own attend."""
    dot = fp8.matmul(family.matmul, family.fp8_block)
    ck = p["kv_norm"]["scale"].shape[-1]
    nope = p["wk_b"].shape[-1]

    def turn(t):
        return rope.rotate(t, where, family.rope_theta, family.rope_scaling)
    q = queries(p, x, family)
    q = jnp.concatenate([q[..., :nope], turn(q[..., nope:])], axis=-1)
    latent = dot("btd,dr->btr", x, p["wkv_a"])
    c = rms_norm(latent[..., :ck], p["kv_norm"]["scale"], family.norm_eps)
    shared = turn(latent[..., None, ck:])  # [B, T, 1, rope]: one key every head shares
    k_nope = dot("btr,rhk->bthk", c, p["wk_b"])
    k = jnp.concatenate([k_nope, jnp.broadcast_to(shared, (*k_nope.shape[:3],
                                                           shared.shape[-1]))], axis=-1)
    v = dot("btr,rhk->bthk", c, p["wv_b"])
    width = v.shape[-1]
    # the fused kernels take v as wide as k (zeros are exact); the cp ring has its own
    if kernel != "einsum" and getattr(seq, "cp", 1) == 1:
        if width > q.shape[-1]:
            raise attentionlib.KernelError(
                f"the {kernel} kernel needs v_head_dim={width} <= qk_nope_dim + qk_rope_dim"
                f"={q.shape[-1]}; use attention einsum")
        v = jnp.pad(v, [(0, 0)] * 3 + [(0, q.shape[-1] - width)])
    out = (attentionlib.attend if seq is None else seq.attend)(q, k, v, kernel)
    return reduce(dot("bthk,hkd->btd", out[..., :width], wo))
