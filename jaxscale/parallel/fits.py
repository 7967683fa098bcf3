"""Whether a plan fits a model's shape: tp against the heads and the MLP's widths, pp x
virtual against the layers, cp and sequence parallelism against the sequence, ep against
the experts and the layouts a mixture of experts runs under, fp8-block's tiles. Each
refusal names the bad value and the choices that fit (jaxscale.parallel.plan.PlanError),
before anything is compiled."""
from __future__ import annotations

from jaxscale.model import fp8
from jaxscale.model.config import ModelConfig
from jaxscale.parallel import context
from jaxscale.parallel.plan import PlanError


def splits_kv_heads(kv_heads: int, tp: int) -> bool:
    """Whether tp splits grouped-query attention's k/v heads (it must divide them)."""
    return kv_heads % tp == 0


def kv_heads_note(cfg: ModelConfig, plan) -> str | None:
    """What tensor parallelism does with grouped-query attention's k/v heads when it cannot
    split them (None when it can, or there is no tp)."""
    if plan.tp == 1 or cfg.kv_heads == cfg.n_heads or splits_kv_heads(cfg.kv_heads, plan.tp):
        return None
    return (f"tp={plan.tp} does not divide the {cfg.kv_heads} k/v heads: K and V stay whole "
            "on every tp device, each device picks for each of its query heads the k/v head "
            "it reads, and their gradients are summed over tp once per step")


def _chunk_choices(layers: int, pp: int, v: int) -> str:
    """What divides `layers`: other pp for this virtual, other virtual for this pp."""
    pps = [k for k in range(1, layers + 1) if layers % (k * v) == 0]
    vs = [k for k in range(1, layers + 1) if layers % (pp * k) == 0]
    options = ([f"with virtual={v} choose pp from {pps}"] if pps else
               [f"no pp works with virtual={v}"])
    options.append(f"with pp={pp} choose virtual from {vs}" if vs else
                   f"pp={pp} alone is more than the layers")
    return "; ".join(options)


def check_experts(cfg: ModelConfig, plan) -> None:
    """Refuse expert parallelism without experts, an ep that does not divide them, and the
    layouts a mixture of experts does not run under yet (tp against each expert's width:
    `check_divisible`)."""
    check_latent(cfg, plan)
    e = cfg.n_experts
    if not e:
        if plan.ep > 1:
            raise PlanError(f"ep={plan.ep} splits a mixture of experts' experts, but the "
                            "model has none; use a model with experts (e.g. tiny-moe) or ep=1")
        return
    if e % plan.ep:
        raise PlanError(f"ep={plan.ep} must divide the {e} experts; choose ep from "
                        f"{[k for k in range(1, e + 1) if e % k == 0]}")
    if plan.family(cfg).matmul == "fp8-delayed":
        raise PlanError(f"a mixture of experts runs in FP8 with current scaling (fp8, "
                        f"fp8-block: each expert scales its own tensors), not yet with "
                        f"precision {plan.precision} (its experts carry no amax histories); "
                        "use fp8, fp8-block or a precision without FP8")
    if plan.pp == 1:
        return
    if cfg.first_dense:
        raise PlanError(f"a mixture of experts in a pipeline (pp={plan.pp}) needs stages of "
                        f"alike blocks, not yet with first_dense={cfg.first_dense} (dense blocks "
                        "first); use pp=1")


def check_latent(cfg: ModelConfig, plan) -> None:
    """Refuse fp8-delayed for latent attention (its products carry no amax histories
    yet); current scaling (fp8) and fp8-block's tiles need none."""
    if cfg.kv_lora_rank and plan.family(cfg).matmul == "fp8-delayed":
        raise PlanError(f"latent attention (kv_lora_rank={cfg.kv_lora_rank}) runs with every "
                        f"layout tested (dp, tp, sp, cp, ep, ZeRO) and in FP8 with current "
                        f"scaling, not yet with precision {plan.precision} (its products "
                        "carry no amax histories); use fp8, fp8-block or a precision without "
                        "FP8")


def check_divisible(cfg: ModelConfig, plan) -> None:
    """Refuse a plan whose tp, pp x virtual, cp, sp or ep does not divide the model's
    shape."""
    check_experts(cfg, plan)
    v = plan.virtual
    widths = cfg.mlp_widths  # the MLP's, each expert's, or both (interleaved)
    if any((cfg.n_heads % plan.tp, *(w % plan.tp for w in widths))):
        fits = [k for k in range(1, cfg.n_heads + 1)
                if cfg.n_heads % k == 0 and all(w % k == 0 for w in widths)]
        raise PlanError(f"tp={plan.tp} must divide the heads ({cfg.n_heads}) and the MLP "
                        f"width ({' and '.join(map(str, widths))}); choose tp from {fits}")
    if plan.pp > 1 and cfg.n_layers % (plan.pp * v):
        raise PlanError(f"pp x virtual = {plan.pp} x {v} = {plan.pp * v} chunks must divide "
                        f"the {cfg.n_layers} layers; {_chunk_choices(cfg.n_layers, plan.pp, v)}")
    groups, n = cfg.n_layers // cfg.moe_every, cfg.moe_every
    if plan.pp > 1 and n > 1 and groups % (plan.pp * v):
        raise PlanError(f"pp x virtual = {plan.pp * v} chunks must each hold whole groups "
                        f"of moe_every={n} blocks (the {cfg.n_layers} layers make {groups}); "
                        f"{_chunk_choices(groups, plan.pp, v)}")
    if plan.cp > 1:
        try:
            context.check_layout(cfg.seq_len, plan.cp)
        except context.ContextError as e:
            raise PlanError(str(e)) from None
    if plan.family(cfg).matmul == "fp8-block":  # every product's tiles, on one device
        widths = (("d_ff", cfg.d_ff, cfg.dense_layers),
                  ("each expert's d_ff", cfg.expert_d_ff, cfg.moe_layers),
                  ("the shared experts' d_ff", cfg.n_shared_experts * cfg.expert_d_ff,
                   cfg.moe_layers))
        dims = {"d_model": cfg.d_model, "head_dim": cfg.head_dim,
                **{f"{name} per device": w // plan.tp for name, w, n in widths if n and w}}
        if plan.fp8_head:
            dims["vocab_size"] = cfg.vocab_size
        try:
            fp8.check_tiles(dims, plan.fp8_block)
        except ValueError as e:
            raise PlanError(str(e)) from None
    if plan.sequence_parallel and (cfg.seq_len // plan.cp) % plan.tp:
        raise PlanError(f"sequence parallelism splits each device's {cfg.seq_len // plan.cp} "
                        f"tokens (seq_len {cfg.seq_len} / cp {plan.cp}) over tp={plan.tp}, "
                        "which does not divide them; choose tp dividing "
                        f"{cfg.seq_len // plan.cp}")
