"""The model's parameters in closed form, from its ModelConfig alone (no arrays built):
what the calculators read for published shapes, checked against the built model's own
count (tests/model)."""
from __future__ import annotations


def param_count(cfg, active: bool = False) -> int:
    """Closed-form number of parameters, every tensor counted (biases and norms too).
    `active`: those one token uses (a mixture of experts: top_k of its routed experts)."""
    d, v, t = cfg.d_model, cfg.vocab_size, cfg.seq_len
    b = int(cfg.bias)
    attention = attention_params(cfg) + b * (2 * d + 2 * cfg.kv_heads * cfg.head_dim)

    def mlp(f, bias=b):  # one MLP of hidden width f
        n = 3 if cfg.mlp == "swiglu" else 2  # (SwiGLU: b1 and b3, f each)
        return n * d * f + bias * ((n - 1) * f + d)
    used = cfg.top_k if active else cfg.n_experts
    # the router, the routed experts, the shared ones (no biases); 0 layers if dense
    experts = d * cfg.n_experts + mlp(cfg.expert_d_ff * (used + cfg.n_shared_experts), 0)
    ffn = cfg.moe_layers * experts + cfg.dense_layers * mlp(cfg.d_ff)
    norm = d * (1 + (cfg.norm == "layernorm" and cfg.bias))  # a scale (+ a bias)
    embeddings = v * d * (1 if cfg.tied_head else 2) + (t * d if cfg.position == "learned" else 0)
    return embeddings + cfg.n_layers * (attention + 2 * norm) + ffn + norm


def attention_params(cfg, norms: bool = True) -> int:
    """One block's attention weights, biases left out: Wq, Wo (d x d), Wk, Wv (d x d_kv);
    latent attention: the latents' down-projections and norms (`norms`: the scales of
    the two latent norms too), the heads' up-projections (q: heads x (nope + rope); k:
    heads x nope, v: heads x v_head_dim) and Wo."""
    d, h, kv = cfg.d_model, cfg.n_heads, cfg.kv_heads * cfg.head_dim
    if not cfg.kv_lora_rank:
        return 2 * d * d + 2 * d * kv
    cq, ck, qk = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_dim
    scales = int(norms)
    q = (d * cq + scales * cq + cq * h * qk) if cq else d * h * qk
    kv_latent = (d * (ck + cfg.qk_rope_dim) + scales * ck
                 + ck * h * (cfg.qk_nope_dim + cfg.v_dim))
    return q + kv_latent + h * cfg.v_dim * d
