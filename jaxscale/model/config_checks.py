"""ModelConfig's checks of its mixture-of-experts and latent-attention options: each names
the bad value and the valid choices, before anything is built."""
from __future__ import annotations

import dataclasses


class ModelConfigError(ValueError):
    """A model configuration is inconsistent."""


MOE_OPTIONS = ("top_k", "moe_d_ff", "n_shared_experts", "capacity_factor", "moe_every",
               "first_dense")
LATENT_OPTIONS = ("q_lora_rank", "kv_lora_rank", "qk_nope_dim", "qk_rope_dim", "v_head_dim")


def _default(cfg, name: str):
    return next(f.default for f in dataclasses.fields(cfg) if f.name == name)


def latent(cfg) -> None:
    """Raise ModelConfigError for latent-attention dimensions no model could have."""
    dims = {n: getattr(cfg, n) for n in LATENT_OPTIONS}
    if not cfg.kv_lora_rank:
        if any(dims.values()):
            raise ModelConfigError(f"{dims} configure latent attention; set "
                                   "kv_lora_rank > 0 (e.g. the tiny-deepseek preset)")
        return
    if min(dims.values()) < 0 or not (cfg.qk_rope_dim > 0 and cfg.v_head_dim > 0):
        raise ModelConfigError(f"latent attention needs qk_rope_dim and v_head_dim > 0 "
                               f"and no dimension below 0, got {dims}")
    if cfg.position != "rope" or cfg.qk_rope_dim % 2 or cfg.n_kv_heads or cfg.bias:
        raise ModelConfigError(
            f"latent attention rotates its qk_rope_dim={cfg.qk_rope_dim} (even) "
            f"dimensions and rebuilds every head's k and v without biases: it needs "
            f"position 'rope' (got {cfg.position!r}), n_kv_heads 0 (got {cfg.n_kv_heads}) "
            f"and bias False (got {cfg.bias})")


def experts(cfg) -> None:
    """Raise ModelConfigError for mixture-of-experts options no model could have."""
    e, k, cf = cfg.n_experts, cfg.top_k, cfg.capacity_factor
    for name in ("n_experts", "moe_d_ff", "n_shared_experts", "router_aux_weight",
                 "router_z_weight"):
        if getattr(cfg, name) < 0:
            raise ModelConfigError(f"{name} must be >= 0, got {getattr(cfg, name)}")
    if not e:
        moe = [f"{n}={getattr(cfg, n)}" for n in MOE_OPTIONS
               if getattr(cfg, n) != _default(cfg, n)]
        if moe:
            raise ModelConfigError(f"{', '.join(moe)} configure experts, but the model "
                                   "has none; set n_experts > 0 (e.g. the tiny-moe preset)")
        return
    if not 1 <= k <= e:
        raise ModelConfigError(f"top_k={k} experts per token out of n_experts={e}; "
                               f"choose top_k from 1 to {e}")
    n, L = cfg.moe_every, cfg.n_layers
    if not isinstance(n, int) or isinstance(n, bool) or n < 1 or L % n:
        raise ModelConfigError(f"moe_every={n} must divide n_layers={L} (every n-th block "
                               f"holds the experts); choose from "
                               f"{[m for m in range(1, L + 1) if L % m == 0]}")
    if not 0 <= cfg.first_dense < L or (cfg.first_dense and n > 1):
        raise ModelConfigError(f"first_dense={cfg.first_dense} dense blocks must leave "
                               f"experts in some of the {L} (0 to {L - 1}), with "
                               f"moe_every 1 (got {n})")
    if cf is not None and (not isinstance(cf, (int, float)) or isinstance(cf, bool)
                           or not cf > 0):
        raise ModelConfigError(f"capacity_factor must be > 0 (1.0: each expert takes its "
                               f"fair share of tokens), or None for dropless; got {cf}")
