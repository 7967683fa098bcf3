"""What a strategy should cost, from closed forms: the parameters one device holds, its
model-state bytes and the ring bytes it sends per step, by collective and by mesh axis
(jaxscale.costmodel and the structure of our model), so that every number
`strategies.run_strategy` measures has a predicted one beside it."""
from __future__ import annotations

import math

import jax
from flax import nnx

from jaxscale import costmodel as cm
from jaxscale.compare.strategies import CompareError
from jaxscale.model import config as model_config, formats, moe, precision
from jaxscale.model import transformer as modellib
from jaxscale.parallel.fits import splits_kv_heads
from jaxscale.parallel.hybrid import param_specs
from jaxscale.parallel.layouts import Replicated
from jaxscale.parallel.mesh_layouts import local_shapes
from jaxscale.parallel.tick_table import tick_table
from jaxscale.parallel.plan import Plan
from jaxscale.parallel.schedules import SPLIT
from jaxscale.parallel.zero import stage3_ring_bytes
from jaxscale.parallel.zero_layout import ZERO_LAYOUTS
from jaxscale.runtime.mesh import MESH_AXES


def params_per_device(cfg: model_config.ModelConfig, plan: Plan) -> dict[str, float]:
    """Closed form: parameters one device holds before ZeRO (tp splits the heads and the
    MLP width, pp the layers; embeddings, norms and output biases are replicated, and so
    are grouped-query attention's K and V where tp does not divide their heads).
    "kv_replicated": those K and V parameters (and biases) of the layers here, if any."""
    d, L, tp, here = cfg.d_model, cfg.n_layers, plan.tp, 1 / plan.pp  # (pp: its layers)
    b, n_mlp = int(cfg.bias), (3 if cfg.mlp == "swiglu" else 2)
    # a mixture of experts' layers: the experts here, split over ep and tp; the shared
    # experts (an MLP without biases, split by tp) and the router (whole)
    fe, moe = cfg.expert_d_ff, cfg.moe_layers * here
    experts = moe * n_mlp * d * fe * cfg.n_experts / plan.ep / tp
    mlp_split = (cfg.dense_layers * here * (n_mlp * d * cfg.d_ff + b * (n_mlp - 1) * cfg.d_ff)
                 + moe * n_mlp * d * fe * cfg.n_shared_experts)  # W1 (W3), W2, b1 (b3)
    mlp_whole = cfg.dense_layers * here * b * d + moe * d * cfg.n_experts  # b2; the router
    norm = d * (1 + (cfg.norm == "layernorm" and cfg.bias))  # a scale (+ a bias)
    kv = 2 * d * cfg.kv_heads * cfg.head_dim + b * 2 * cfg.kv_heads * cfg.head_dim
    kv_split = splits_kv_heads(cfg.kv_heads, tp)
    # Q, O, bq; K, V and their biases when tp splits them; bo, the norms. Latent
    # attention: what is per head split (the up-projections, O), the latents whole
    heads, whole = ((2 * d * d + b * d + (kv if kv_split else 0), b * d + (0 if kv_split else kv))
                    if not cfg.kv_lora_rank else _latent_parts(cfg))
    split = L * here * heads + mlp_split
    replicated = L * here * (whole + 2 * norm) + mlp_whole
    top = (cfg.vocab_size * d * (1 if cfg.tied_head else 2) + norm
           + (cfg.seq_len * d if cfg.position == "learned" else 0))
    blocks = split / tp + replicated + experts
    return {"top": top, "blocks": blocks, "split": split / tp + experts,  # what tp splits
            "kv_replicated": 0 if kv_split else L * here * kv,
            "experts": experts, "total": top + blocks}


def _latent_parts(cfg: model_config.ModelConfig) -> tuple[int, int]:
    """One block's latent-attention weights (model.mla): (split over tp by heads, whole)."""
    whole = model_config.attention_params(cfg) - model_config.attention_params(cfg, False)
    d, cq = cfg.d_model, cfg.q_lora_rank
    whole += d * cq + d * (cfg.kv_lora_rank + cfg.qk_rope_dim)  # the down-projections
    return model_config.attention_params(cfg) - whole, whole


# remat policies that keep no collective's output: backward recomputes a layer's forward
# and with it the collectives whose outputs the layer still needs ("selective" saves
# them by name, jaxscale.model.block.COLLECTIVE, and repeats none)
REPEATS_COLLECTIVES = ("full", "matmuls")


def predictable(plan: Plan, cfg: model_config.ModelConfig | None = None) -> bool:
    """Whether `predict` models the plan. Every precision but fp8-delayed (its amax
    histories are reduced too) and every remat policy, except a pipeline under a policy
    that recomputes collectives, a document mask whose ids would be gathered again, and
    fp8's current scaling under tp with a split backward (W runs a chunk's layers at
    once, so the amaxes it maxes over tp are vectors of them, where every other action's
    are scalars, which the HLO reader leaves out). Every model is modelled, a mixture of
    experts under every layout it runs."""
    repeats = plan.remat in REPEATS_COLLECTIVES
    split_amaxes = (plan.precision == "fp8" and plan.tp > 1 and plan.pp > 1
                    and plan.schedule in SPLIT)
    return (plan.precision != "fp8-delayed" and not split_amaxes
            and not (repeats and (plan.pp > 1 or (cfg is not None and cfg.document_mask))))


def predict(cfg: model_config.ModelConfig, plan: Plan, batch_shape: tuple[int, int]) -> dict:
    """Predicted per-device model-state bytes and ring bytes sent per step (Adam);
    "sent_by_axis" splits the bytes by the mesh axis each collective runs over. A 16-bit
    policy sends its weights' width: half of fp32's bytes, but for the router's loads and
    gradient (fp32 under every policy); a remat policy that recomputes collectives sends
    a layer's again where backward needs their outputs (REPEATS_COLLECTIVES).

    Modelled: dp, tp, pp, cp, sequence_parallel, schedule, virtual, micro_batches,
    zero_stage, and ep for a mixture of experts; other plans are refused (see
    `predictable`)."""
    if not predictable(plan, cfg):
        raise CompareError(f"the prediction covers neither fp8-delayed, a pipeline or a "
                           f"document mask under remat {'/'.join(REPEATS_COLLECTIVES)}, "
                           f"nor fp8 under tp with a split backward; got {plan}")
    psi = params_per_device(cfg, plan)
    k, z, m, cp = plan.dp, plan.zero_stage, plan.micro_batches, plan.cp
    pol = precision.policy(plan.precision)
    per_fp32 = formats.dtype_of(pol.param_dtype).itemsize / 4  # bytes sent per fp32 byte
    repeats = plan.remat in REPEATS_COLLECTIVES
    b, s = batch_shape
    rows = b // plan.rows // m  # rows of one micro-batch on one device (dp x ep split them)
    act = rows * (s // cp) * cfg.d_model * 4  # one micro-batch's x on a cp share (whole)
    sent: dict[str, float] = {}
    by_axis: dict[str, dict[str, float]] = {}

    def add(op, v, axis, fixed=False):  # fixed: the same bytes under every policy
        v = v if fixed else v * per_fp32
        if v:
            sent[op] = sent.get(op, 0.0) + v
            ops = by_axis.setdefault(axis, {})
            ops[op] = ops.get(op, 0.0) + v
    layout = ZERO_LAYOUTS.get(z, Replicated)  # each layout says what its dp reduction sends
    for op, v in layout.dp_bytes(4 * psi["total"], plan, lambda: stage3_census(cfg, plan)).items():
        add(op, v, "dp")
    # the sequence's shares of every gradient (ZeRO: of its slices) summed, after dp's
    # reduction: over cp, and over tp for what tp does not split when sequence parallel
    _shares(plan, {part: 4 * v / (k if z else 1) for part, v in _parts(psi).items()}, add)
    if cp > 1:
        _ring_attention(cfg, plan, rows * (s // cp), repeats, add)
    if plan.tp > 1:
        _tensor_parallel(cfg, plan, psi, act, repeats, add)
    if cfg.n_experts:
        _experts(cfg, plan, rows * (s // cp), add, repeats)
    if cfg.document_mask and (cp > 1 or plan.sequence_parallel):
        g = cp * (plan.tp if plan.sequence_parallel else 1)  # every token's document id
        add("all-gather", m * (g - 1) / g * rows * s * 4, "cp" if cp > 1 else "tp", fixed=True)
    if plan.pp > 1:
        table = tick_table(plan.schedule, plan.pp, m, plan.virtual)
        # every tick an activation and a gradient each way; in a V (zbv) both ways each
        add("collective-permute", (4 if table.vee else 2) * table.ticks * act, "pp")
        # the shared embeddings' and final LayerNorm's gradients (ZeRO: their dp slices)
        add("all-reduce", _ring(4 * psi["top"] / (k if z else 1), plan.pp), "pp")
    states = state_bytes(psi["total"], plan)
    return {"params_per_device": psi["total"], "states": states, "sent": sent,
            "sent_by_axis": by_axis}


def state_bytes(n_params: float, plan: Plan) -> dict[str, float]:
    """Per-device params, grads, optimizer state and their total for `n_params` parameters
    on a device, by the policy's bytes per parameter and ZeRO over dp: fp32 4 + 4 + 8, the
    16-bit policies with fp32 master weights 2 + 2 + 12, bf16-pure 2 + 2 + 4."""
    budget = ("fp32-adam" if plan.precision == "fp32" else
              "mixed-adam" if precision.policy(plan.precision).master_weights else "bf16")
    x = cm.states.state_memory(n_params, plan.dp, plan.zero_stage, budget)
    out = {part: x[part] for part in ("params", "grads", "optimizer")}
    return {**out, "total": sum(out.values())}

def _ring(n: float, g: int) -> float:
    """Bytes one device sends in a ring all-reduce of n bytes over g devices."""
    return 2 * (g - 1) / g * n


def _ring_attention(cfg, plan: Plan, tokens: int, repeats: bool, add) -> None:
    """Ring attention: per layer, cp - 1 hops of k and v forward, of their gradients back
    (k and v as the device's query heads read them: its kv heads where tp splits them,
    else one picked per query head); a remat that repeats collectives runs the forward's
    hops again (`tokens`: one micro-batch's on this device)."""
    width = 2 * (cfg.kv_heads * cfg.head_dim if splits_kv_heads(cfg.kv_heads, plan.tp)
                 else cfg.d_model)
    if cfg.kv_lora_rank:  # latent attention's k and v: every head's, qk and v wide
        width = cfg.n_heads * (cfg.qk_dim + cfg.v_dim)
    kv = tokens * width // plan.tp * 4
    add("collective-permute", (3 if repeats else 2) * (plan.cp - 1) * kv * cfg.n_layers
        * plan.micro_batches, "cp")


def _tensor_parallel(cfg, plan: Plan, psi: dict, act: float, repeats: bool, add) -> None:
    """tp's collectives per step (`act`: one micro-batch's activations on this device,
    fp32 bytes): the layers' all-reduces, or sp's gathers and scatters; latent
    attention's whole down-projections; grouped K and V that tp does not split."""
    tp, m, here = plan.tp, plan.micro_batches, cfg.n_layers // plan.pp
    # an FP8 product sums a whole weight's gradient over tp itself, in fp32 (model.fp8)
    fp8_sums = plan.family(cfg).matmul in ("fp8", "fp8-block")
    if cfg.kv_lora_rank and not plan.sequence_parallel:
        # latent attention's down-projections are whole on every tp device, each using
        # them for its own heads: their gradients all-reduced over tp per layer and
        # micro-batch, in backward (under sp they join the step's reduction instead); the
        # latents' norm scales among them, summed in fp32 under every policy, and under
        # FP8 the down-projections too (each FP8 product sums its weight's gradient itself)
        norms = model_config.attention_params(cfg) - model_config.attention_params(cfg, False)
        per_layer = 2 * (tp - 1) / tp * 4 * here * m
        add("all-reduce", per_layer * (_latent_parts(cfg)[1] - norms), "tp", fixed=fp8_sums)
        add("all-reduce", per_layer * norms, "tp", fixed=True)
    if plan.sequence_parallel:
        # each all-reduce split in two: per layer 2 all-gathers and 2 reduce-scatters
        # forward, the same backward, on the whole cp share; a recomputed forward gathers
        # both again and scatters the attention's output (the MLP's is the layer's output,
        # which backward does not need)
        gathers, scatters = (6, 5) if repeats else (4, 4)
        add("all-gather", gathers * here * m * (tp - 1) / tp * act, "tp")
        add("reduce-scatter", scatters * here * m * (tp - 1) / tp * act, "tp")
        return
    # 2 all-reduces per layer forward, 2 backward; a pipeline recomputes the forward (+2);
    # a split backward (zero-bubble) adds W's 3: its recompute needs the attention's
    # all-reduce, not the MLP's (the block's output is unused), and the two norms' weight
    # gradients each need the all-reduce of the gradient at the norm's output; a remat
    # that repeats collectives, the attention's again (5)
    per_micro = (9 if plan.pp > 1 and plan.schedule in SPLIT
                 else 6 if plan.pp > 1 else 5 if repeats else 4) * here
    add("all-reduce", _ring(per_micro * m * act, tp), "tp")
    # K and V whole on every tp device: each computes the gradient of the heads its query
    # heads read, summed over tp once per step, whole (ZeRO slices it after); in a pipeline
    # once per micro-batch, inside its backward tick. An FP8 product sums it itself, in
    # fp32, in every backward (model.fp8: a cotangent made like its primal)
    add("all-reduce", _ring(4 * psi["kv_replicated"] * (m if plan.pp > 1 or fp8_sums else 1),
                            tp), "tp", fixed=fp8_sums)


def _parts(psi: dict) -> dict[str, float]:
    """A device's parameters by the sequence axes that split them: the experts (ep and
    tp), the rest of what tp splits, and what no model axis splits."""
    return {"experts": psi["experts"], "split": psi["split"] - psi["experts"],
            "whole": psi["total"] - psi["split"]}


def _shares(plan: Plan, grads: dict[str, float], add) -> None:
    """The gradients' shares summed once per step, after dp's reduction (`grads`: bytes
    by `_parts`, ZeRO's slices): the devices that hold other tokens of the same rows (cp;
    tp under sequence parallelism) or other rows (ep) each computed a share of every
    parameter they do not split. One all-reduce per part, over all those axes together:
    the experts over cp, the rest of tp's split over ep x cp, the rest over ep x cp x tp
    (sequence parallel)."""
    over = {"experts": ("cp",), "split": ("ep", "cp"),
            "whole": ("ep", "cp") + (("tp",) if plan.sequence_parallel else ())}
    for part, v in grads.items():
        axes = [a for a in over[part] if getattr(plan, a) > 1]
        g = math.prod(getattr(plan, a) for a in axes)
        if g > 1:
            add("all-reduce", 2 * (g - 1) / g * v, "+".join(_mesh_order(axes)))


def _mesh_order(axes) -> list[str]:
    return [a for a in MESH_AXES if a in axes]


def _experts(cfg, plan: Plan, tokens: int, add, repeats: bool = False) -> None:
    """A mixture of experts' collectives in each MoE layer, per micro-batch
    (jaxscale.model.moe): the tokens' places to the experts' devices and back, two
    all-to-alls of E x C x d over ep in each forward and two (transposed) in each
    backward; the router's load per expert (E floats) summed over every device of the
    micro-batch's tokens (dp, ep, cp, tp) in each forward; and with tp but not sequence
    parallel the router's gradient [d, E] summed over tp in each backward (its input is
    each tp device's own copy of the tokens). A pipeline stage runs its layers' forward
    twice (F, and B's recomputation); the load of the micro-batches' worst layers (m
    floats) then meets over pp once per step (jaxscale.model.moe.over_stages). A split
    backward (zero-bubble) runs it three times (F, B's and W's recomputations) and
    transposes both all-to-alls twice (B for the input's gradient, W for the weights').
    A remat that repeats collectives (`repeats`) runs each forward twice as well. The
    loads and the router's gradient stay fp32 under every precision."""
    e, m = cfg.n_experts, plan.micro_batches
    backwards = cfg.moe_layers // plan.pp * m  # this device's layers' backward passes
    split = plan.pp > 1 and plan.schedule in SPLIT
    forwards = backwards * (3 if split else 2 if plan.pp > 1 or repeats else 1)
    places = moe.capacity(tokens, e, cfg.family)
    transposes = backwards * (2 if split else 1)
    if plan.ep > 1:
        add("all-to-all", 2 * (forwards + transposes) * (plan.ep - 1) / plan.ep * e * places
            * cfg.d_model * 4, "ep")
    axes = [a for a in ("dp", "ep", "cp", "tp") if getattr(plan, a) > 1]
    g = math.prod(getattr(plan, a) for a in axes)
    if g > 1:
        add("all-reduce", forwards * 2 * (g - 1) / g * e * 4, "+".join(_mesh_order(axes)),
            fixed=True)
    if plan.tp > 1 and not plan.sequence_parallel:
        add("all-reduce", backwards * 2 * (plan.tp - 1) / plan.tp * cfg.d_model * e * 4, "tp",
            fixed=True)
    if plan.pp > 1:
        add("all-reduce", 2 * (plan.pp - 1) / plan.pp * m * 4, "pp", fixed=True)
    if plan.tp > 1 and plan.family(cfg).matmul == "fp8":
        # current scaling: every expert product's amaxes (one per expert here), its input's
        # and weight's in each forward, its gradient's in each backward, maxed over tp; a
        # layer under a checkpoint (ZeRO-3's, a remat policy's) runs its forward again in
        # backward, amaxes included (no policy saves them)
        again = backwards if (plan.zero_stage == 3 or plan.remat != "none") and not repeats \
            else 0
        products = 3 if cfg.mlp == "swiglu" else 2
        add("all-reduce", products * (2 * (forwards + again) + transposes)
            * _ring(4 * e / plan.ep, plan.tp), "tp", fixed=True)


def stage3_census(cfg: model_config.ModelConfig, plan: Plan) -> dict[str, float]:
    """ZeRO-3's gathers and reduce-scatters (zero.stage3_ring_bytes) on each device's own
    tp shards (in a pipeline: for one chunk of its layers)."""
    abstract = modellib.abstract(cfg)
    shapes = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
    if plan.tp > 1 or plan.pp > 1 or plan.ep > 1:  # each device's shards (pp: one chunk's layers)
        shapes = local_shapes(shapes, param_specs(modellib.logical_axes(abstract), plan,
                                                    cfg.kv_heads), plan)
        # one chunk of each stack (its own length: interleaved experts' is shorter)
        shapes = {**shapes, "blocks": jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((x.shape[0] // plan.virtual, *x.shape[1:]), x.dtype),
            shapes["blocks"])}
    return stage3_ring_bytes(shapes, plan.dp, 4, plan.sequence_parallel)
