"""Model FLOPs per token of jaxscale's transformer, with the counting convention written down.

A matmul of an [m, k] by a [k, n] matrix costs 2*m*n*k FLOPs (one multiply, one add per
term). Every token meets each weight matrix once in the forward pass, so a model with N
matmul weights spends 2N FLOPs per token forward and 4N backward (one matmul for the
gradient of the activations, one for the gradient of the weights): 6N per token.

  N          L * (2 d^2 + 2 d d_kv + n d f)  +  V d
             Wq Wo, Wk Wv, W1 W2 (W3)   the output head (tied or not: one matmul)
             d_kv = kv_heads x head_dim (grouped-query attention; d without it), n = 2, or
             3 with SwiGLU. A mixture of experts: the top_k experts a token uses (each
             n d f_e) and the router (d E) in the MLP's place; its shared experts too.
             Embedding lookups (token, position) gather rows; biases, LayerNorms, GELU and
             softmax are elementwise: none of them is counted.
  attention  12 L s d per token. Forward, per layer and token: the query meets s keys
             (q k^T, 2 s d) and s values (weights @ v, 2 s d); times 3 with backward.
             Latent attention (model.mla): 6 L s heads (qk_dim + v_dim), its q.k and its
             values of their own widths; its N counts the latents' down-projections and
             the heads' up-projections in place of Wq, Wk, Wv (model.counts).
             Counted non-causal, all s x s scores, as PaLM (appendix B) and MaxText do;
             the causal mask leaves half of them useful (`attention_causal`).

MFU divides these *model* FLOPs by the time taken. Work the run does on top, recomputing
activations (remat), is *hardware* FLOPs: it counts in HFU, never in MFU, so that a policy
that trades compute for memory does not look "more utilised". `recompute_flops_per_token`
gives that extra work; `hand_count` checks the formula by walking the actual matmul shapes;
`xla_flops` reads XLA's own count, which has blind spots (see there).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from jaxscale.model.config import ModelConfig, ModelConfigError
from jaxscale.model.counts import attention_params
from jaxscale.model.transformer import check_compute

CONVENTION = ("model FLOPs/token = 6N (N = L(2d^2 + 2d d_kv + n d f) + Vd matmul weights, n = 2"
              " or 3 with SwiGLU, a token's top_k experts and the router for a mixture of"
              " experts; fwd 2N + bwd 4N) + 12 L s d attention (non-causal s x s, as"
              " PaLM/MaxText); no remat, no elementwise ops")


@dataclass(frozen=True)
class FlopCount:
    """Training FLOPs per token (forward + backward) of one model at one sequence length."""

    matmul_params: int  # N: block matmul weights + the tied output head
    dense: int  # 6 N
    attention: int  # 12 L s d, non-causal
    attention_causal: int  # 6 L s d: only the unmasked half of the scores
    seq_len: int
    convention: str = CONVENTION

    @property
    def total(self) -> int:
        """The figure MFU uses: dense + non-causal attention."""
        return self.dense + self.attention

    @property
    def total_causal(self) -> int:
        return self.dense + self.attention_causal

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total, "total_causal": self.total_causal}


def block_matmul_params(cfg: ModelConfig) -> int:
    """Matmul weights a token meets in the L blocks: Wq, Wo (d x d), Wk, Wv (d x d_kv),
    the MLP's (or its top_k experts', the router and the shared experts')."""
    d, n = cfg.d_model, (3 if cfg.mlp == "swiglu" else 2)
    attention = attention_params(cfg, norms=False)
    experts = d * cfg.n_experts + (cfg.top_k + cfg.n_shared_experts) * n * d * cfg.expert_d_ff
    return (cfg.n_layers * attention + cfg.moe_layers * experts
            + cfg.dense_layers * n * d * cfg.d_ff)


def model_flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> FlopCount:
    """Forward + backward FLOPs per token at `seq_len` (default cfg.seq_len)."""
    s = cfg.seq_len if seq_len is None else seq_len
    n = block_matmul_params(cfg) + cfg.vocab_size * cfg.d_model
    # q.k over qk_dim and weights @ v over v_dim, per head (12 L s d without latent attention)
    attention = 6 * cfg.n_layers * s * cfg.n_heads * (cfg.qk_dim + cfg.v_dim)
    return FlopCount(matmul_params=n, dense=6 * n, attention=attention,
                     attention_causal=attention // 2, seq_len=s)


def recompute_flops_per_token(cfg: ModelConfig, remat: str, seq_len: int | None = None) -> int:
    """Extra forward FLOPs per token that the remat policy spends in backward (HFU - MFU).

      none     0: every activation backward needs is kept.
      full     one more forward of the blocks (each block's input is kept, the rest
               recomputed): 2 N_blocks + 4 L s d attention (latent attention: 2 L s
               heads (qk_dim + v_dim), as everywhere below). The head is not checkpointed.
      matmuls  0 matmul FLOPs: the dot outputs are kept (dots_saveable); only elementwise
               work (LayerNorm, GELU, softmax) is recomputed, and that is never counted.
      selective  the attention core again (q k^T and softmax(.) v, the batched matmuls
               that dots_with_no_batch_dims_saveable drops): 4 L s d.
    """
    check_compute(remat)
    core = model_flops_per_token(cfg, seq_len).attention // 3  # the cores' forward
    if remat == "selective":
        return core
    if remat != "full":
        return 0
    return 2 * block_matmul_params(cfg) + core


def hand_count(cfg: ModelConfig, batch: int, seq: int) -> int:
    """Forward FLOPs of one [batch, seq] batch, einsum by einsum (jaxscale.model.transformer), each
    as 2 * (product of all the dimensions it names). Independent of the formula above:
    3 * hand_count / (batch * seq) must equal model_flops_per_token(cfg, seq).total."""
    if seq > cfg.seq_len:
        raise ModelConfigError(f"seq={seq} exceeds seq_len={cfg.seq_len}")
    b, t, d, h, k = batch, seq, cfg.d_model, cfg.n_heads, cfg.head_dim
    v, s, kv = cfg.vocab_size, seq, cfg.kv_heads  # s: the keys each query meets (no mask)
    one_layer = (
        2 * b * t * d * h * k  # q = btd,dhk->bthk
        + 2 * b * t * d * kv * k  # k = btd,dhk->bthk (kv heads)
        + 2 * b * t * d * kv * k  # v = btd,dhk->bthk
        + 2 * b * h * t * s * k  # scores = bqhk,bshk->bhqs (k, v repeated per group)
        + 2 * b * h * t * s * k  # out = bhqs,bshk->bqhk
        + 2 * b * t * h * k * d  # bthk,hkd->btd (Wo)
    ) if not cfg.kv_lora_rank else _latent_count(cfg, b * t, s)
    head = 2 * b * t * d * v  # logits = btd,vd->btv
    return cfg.n_layers * one_layer + _mlp_count(cfg, b * t) + head


def _latent_count(cfg: ModelConfig, tokens: int, s: int) -> int:
    """One layer of latent attention's forward FLOPs for `tokens` (model.mla's einsums)."""
    d, h, cq, ck, r = (cfg.d_model, cfg.n_heads, cfg.q_lora_rank, cfg.kv_lora_rank,
                       cfg.qk_rope_dim)
    qk, nope, vd = cfg.qk_dim, cfg.qk_nope_dim, cfg.v_dim
    queries = 2 * tokens * (d * cq + cq * h * qk) if cq else 2 * tokens * d * h * qk
    return (queries
            + 2 * tokens * d * (ck + r)  # the kv latent and the shared key: btd,dr->btr
            + 2 * tokens * ck * h * nope  # k's heads: btr,rhk->bthk
            + 2 * tokens * ck * h * vd  # v's heads
            + 2 * tokens * h * s * qk  # scores over nope + rope
            + 2 * tokens * h * s * vd  # weights @ v
            + 2 * tokens * h * vd * d)  # Wo


def _mlp_count(cfg: ModelConfig, tokens: int) -> int:
    """The MLPs' forward FLOPs for `tokens`, over the layers: x @ W1 (and W3) [d, f], h @
    W2 [f, d]; a mixture of experts' layers: the router [d, E], each token's top_k experts
    and the shared."""
    d, n = cfg.d_model, (3 if cfg.mlp == "swiglu" else 2)
    routed = (cfg.top_k + cfg.n_shared_experts) * n * 2 * tokens * d * cfg.expert_d_ff
    return (cfg.dense_layers * n * 2 * tokens * d * cfg.d_ff
            + cfg.moe_layers * (2 * tokens * d * cfg.n_experts + routed))


def xla_flops(compiled) -> float | None:
    """The `flops` of `compiled.cost_analysis()` (a jax Compiled); None when it has none.

    Newer JAX returns a dict, older a list of one dict per program; both are read. XLA's
    count is per op of the optimised HLO, once per op, and so misses work in two places
    (measured with jax 0.10.2 on CPU, tests/model/test_flops.py):
      loops      the body of a while loop (lax.scan, fori_loop) is counted ONCE, not trip-
                 count times: a scan of 8 [64,64] matmuls reports 524,290 FLOPs, 1/8 of the
                 4,194,304 done (2 n^3 + 2 for the loop counter); with unroll=True the full
                 4,194,304. jaxscale's blocks are such a scan: the `small` preset's forward
                 (4 layers, batch 4) reports 437.9M, its true 1,691M; one layer + head: 432.7M.
      custom     custom calls are opaque: a 64 x 64 Cholesky (LAPACK potrf, ~n^3/3 = 87k
      calls      FLOPs) reports only its 20,480 elementwise FLOPs around it; a program that
                 is only a host callback reports -1 ("unknown", returned as None here).
                 cuDNN kernels on GPU (flash attention) are custom calls too: expect 0 for
                 them (not measured here: no GPU).
    It also counts elementwise ops (softmax, GELU) that model FLOPs leave out.
    """
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    flops = (cost or {}).get("flops")
    return None if flops is None or flops < 0 else float(flops)
