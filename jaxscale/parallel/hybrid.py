"""Tensor, pipeline, context, expert and data parallelism together: one shard_map over the
(dp, ep, pp, cp, tp) mesh.

Where each parameter lives follows from its logical axis names (jaxscale.model.transformer), by rules:

    heads -> tp    Q, K, V split by output heads, O by input heads        (Megatron)
    kv_heads -> tp K and V of grouped-query attention, when tp divides their heads;
                   otherwise whole on every tp device (each picks the heads its query
                   heads read: jaxscale.model.block.local_kv)
    mlp   -> tp    W1 (and SwiGLU's W3) split by output columns, W2 by input rows
    layers -> pp   each pipeline stage holds its own layers
    experts -> ep  a mixture of experts' experts split over ep (jaxscale.model.moe); the
                   router stays whole: every device routes its tokens to every expert
    anything else  replicated: embeddings, norms, output biases

Inside the step: the blocks run tensor parallel over `tp` (two all-reduces per layer
forward, two backward: jaxscale.model.transformer.block), the pipeline schedule runs over `pp`
(jaxscale.parallel.pipeline) or, with pp = 1, micro-batches accumulate as in plain DP, and
the gradients are all-reduced over `dp`. With cp > 1 every device holds T/cp of each
row's tokens (jaxscale.parallel.context: the tokens in zig-zag order, attention a ring
over `cp`); the parameters are replicated over cp, so their gradients are all-reduced
over dp and cp together. The optimizer updates each device's own shards;
it must be elementwise (as for ZeRO). With zero_stage=1 the optimizer state (and fp32
master weights) is also split over `dp`, as in jaxscale.parallel.zero, on each device's
own (tp- and pp-) shards: the dp all-reduce becomes a reduce-scatter, the update runs on
the owned slice, and an all-gather over dp rebuilds the shard.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxscale.model import fp8, fp8_history, precision, transformer as modellib
from jaxscale.model.config import ModelConfig
from jaxscale.model.loss import logits_nll_and_count
from jaxscale.parallel import context, step as steplib
from jaxscale.parallel.axes import CP, DP, EP, PP, TP
from jaxscale.parallel.canonical import Canonical, param_infos
from jaxscale.parallel.step import PlanStep, shard_step
from jaxscale.parallel.data_parallel import accumulated_value_and_grad
from jaxscale.parallel.mesh_layouts import is_spec, layer_order, mesh_layout, state_flat_specs
from jaxscale.parallel.pipeline import pipeline_value_and_grad
from jaxscale.parallel.schedules import VEE
from jaxscale.parallel.tick_table import tick_table
from jaxscale.parallel.plan import PlanError
from jaxscale.runtime.vma import vary
from jaxscale.parallel.zero import check_elementwise, forward_gathered, gathered_units
from jaxscale.runtime import mesh as meshlib

RULES = {"heads": "tp", "kv_heads": "tp", "mlp": "tp", "layers": "pp", "experts": "ep"}


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


def param_specs(logical, plan, kv_heads: int = 0):
    """PartitionSpec of every parameter from its logical axes (axes of size-1 mesh dims
    are left out, so a tp=1 plan does not mention tp). `kv_heads`: the model's k/v heads
    where fewer than its query heads (their axis is "kv_heads")."""
    live = {name: mesh for name, mesh in RULES.items() if getattr(plan, mesh) > 1
            and (name != "kv_heads" or splits_kv_heads(kv_heads, plan.tp))}
    return jax.tree.map(lambda names: P(*(live.get(n) for n in names)), logical,
                        is_leaf=lambda x: isinstance(x, tuple))


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
    e = cfg.n_experts
    if not e:
        if plan.ep > 1:
            raise PlanError(f"ep={plan.ep} splits a mixture of experts' experts, but the "
                            "model has none; use a model with experts (e.g. tiny-moe) or ep=1")
        return
    if e % plan.ep:
        raise PlanError(f"ep={plan.ep} must divide the {e} experts; choose ep from "
                        f"{[k for k in range(1, e + 1) if e % k == 0]}")
    later = [what for what, on in (
        (f"pp={plan.pp}", plan.pp > 1),
        (f"precision {plan.precision}", plan.family(cfg).matmul != "native")) if on]
    if later:
        raise PlanError(f"a mixture of experts runs with dp, ep, tp, cp, sp and ZeRO, "
                        f"not yet with {' or '.join(later)}; use pp=1 and a precision "
                        "without FP8")


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
    if plan.cp > 1:
        try:
            context.check_layout(cfg.seq_len, plan.cp)
        except context.ContextError as e:
            raise PlanError(str(e)) from None
    if plan.family(cfg).matmul == "fp8-block":  # every product's tiles, on one device
        dims = {"d_model": cfg.d_model, "head_dim": cfg.head_dim,
                "d_ff per device": cfg.d_ff // plan.tp}
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


def build_hybrid(model_cfg, graphdef, plan, optimizer: optax.GradientTransformation,
                 pol: precision.Policy, shapes, logical, devices=None):
    """(init, step) for a plan with tp, pp or cp > 1 (and any dp, any ZeRO stage):
    `shapes` the parameters' shapes, `logical` their logical axis names."""
    check_divisible(model_cfg, plan)
    devices = list(jax.devices() if devices is None else devices)[:plan.n_devices]
    mesh = meshlib.make_mesh(plan.mesh_shape, devices)
    specs = param_specs(logical, plan, model_cfg.kv_heads)
    order = layer_order(model_cfg.n_layers, plan.pp, plan.virtual, plan.schedule in VEE)
    check_elementwise(jax.eval_shape(optimizer.init, shapes), shapes,
                      who="tensor/pipeline parallelism")
    layout = mesh_layout(plan, shapes, specs, order, mesh)
    grad_fn = (pipeline_grad_fn(model_cfg, plan, layout, specs) if plan.pp > 1
               else sequence_grad_fn(model_cfg, plan, layout, specs))
    update = steplib.make_step(graphdef, optimizer, pol, jit=False, layout=layout,
                               grad_fn=grad_fn)
    state_specs = _state_specs(plan, optimizer, pol, shapes, specs)
    seq_axes, rows = sequence_axes(plan), row_axes(plan)
    if seq_axes:  # whole rows arrive on dp: reordered for the ring, split
        compiled, guarded = shard_step(
            update, mesh, state_specs, batch_spec=P(rows, seq_axes),
            prepare=lambda b: context.prepare(b, plan.cp, document_mask=model_cfg.document_mask))
    else:
        compiled, guarded = shard_step(update, mesh, state_specs, batch_spec=P(rows))
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), state_specs, is_leaf=is_spec)
    infos = param_infos(shapes, specs)
    step = PlanStep(
        mesh, compiled,  # whole parameters in the model's layer order
        jax.jit(lambda state: jax.tree.map(layout.params_to_canonical, state.params, infos)),
        Canonical(layout, optimizer, pol, shapes, mesh, shardings, specs), guarded)
    step.batch_sharding = NamedSharding(mesh, P(rows))  # the rows where the step reads them
    return _init(plan, optimizer, pol, layout, mesh, specs, state_specs, order), step


def row_axes(plan):
    """The mesh axes that split the batch's rows: dp, and ep with it (dp outermost)."""
    return (DP, EP) if plan.ep > 1 else DP


def sequence_axes(plan) -> tuple[str, ...]:
    """The mesh axes that split each row's tokens: cp (a ring), and tp when sequence
    parallel."""
    return tuple(a for a, on in ((CP, plan.cp > 1), (TP, plan.sequence_parallel)) if on)


def pipeline_grad_fn(model_cfg, plan, layout, specs):
    """The pipeline schedule over pp; the gradients reduced over dp as the layout says,
    and over pp for the parameters every stage holds."""
    tp_axis = TP if plan.tp > 1 else None
    shared = jax.tree.map(lambda s: PP not in s, specs, is_leaf=is_spec)
    units = (gathered_units(layout.fetch, plan.remat, plan.attention, plan.unroll, tp_axis,
                            family=plan.family(model_cfg))
             if plan.zero_stage == 3 else None)
    return pipeline_value_and_grad(
        plan, tick_table(plan.schedule, plan.pp, plan.micro_batches, plan.virtual),
        tp_axis=tp_axis, replicated_over_pp=shared, reduction=layout.reduction(), units=units,
        d_model=model_cfg.d_model, family=plan.family(model_cfg))


def sequence_grad_fn(model_cfg, plan, layout, specs):
    """Micro-batches accumulated as in plain DP, each row's tokens split over the sequence
    axes (cp, and tp when sequence parallel)."""
    seq_axes = sequence_axes(plan)
    tp_axis = TP if plan.tp > 1 else None
    sp = plan.tp if plan.sequence_parallel else 1

    def sequence(mb):
        return (context.sequence(mb, plan.cp, sp=sp) if seq_axes
                else modellib.sequence(model_cfg, mb["tokens"]))

    def nll(prm, mb, history=None):
        prm = fp8_history.attach(prm, history)
        if plan.zero_stage == 3:  # prm: my dp slices of my tp shards, gathered per unit
            logits, stats = forward_gathered(prm, mb["tokens"], plan.remat, layout.fetch,
                                             plan.attention, plan.unroll, tp_axis,
                                             sequence(mb), plan.family(model_cfg))
        else:
            logits, stats = modellib.forward_with_stats(
                prm, mb["tokens"], plan.remat, tp_axis=tp_axis, attention=plan.attention,
                unroll=plan.unroll, seq=sequence(mb), family=plan.family(model_cfg))
        out = logits_nll_and_count(logits, mb)
        return (*out, stats) if stats else out

    # The devices that split the sequence (or, with ep, the rows) hold different tokens,
    # so each parameter's gradient has a share on each: summed over cp and ep, and over
    # tp (sequence parallel), for the parameters those axes do not split (an expert lives
    # on one ep device only), after dp's reduction (ZeRO: on slices). Each device
    # differentiates its own copy over dp and those axes (ZeRO-3: its slices are its own
    # over dp already); otherwise autodiff would sum the shares over tp itself, once per
    # use (the tied embedding: twice).
    split = ((EP,) if plan.ep > 1 else ()) + seq_axes

    def over_sequence(g):
        def one(x, spec):
            axes = tuple(a for a in split if a not in spec)
            return lax.psum(x, axes) if axes else x
        return jax.tree.map(one, g, specs, is_leaf=is_spec) if split else g

    mine = ((DP,) if plan.zero_stage != 3 else ()) + split
    reduction = dataclasses.replace(
        layout.reduction(), then=over_sequence,
        own=lambda p: jax.tree.map(lambda x: vary(x, mine), p) if mine else p)
    return accumulated_value_and_grad(nll, plan.micro_batches, reduction,
                                      batch_axes=(DP, *split))


def _state_specs(plan, optimizer, pol, shapes, specs) -> steplib.TrainState:
    """Where each piece of the training state lives on the mesh."""
    flat = state_flat_specs(plan, specs)
    history = jax.eval_shape(lambda p: steplib.init_state(p, optimizer, pol).fp8, shapes)
    return steplib.TrainState(
        flat if plan.zero_stage == 3 else specs, flat if pol.master_weights else None,
        optax.tree_map_params(optimizer, lambda _, s: s, jax.eval_shape(optimizer.init, shapes),
                              flat, transform_non_params=lambda _: P(), is_leaf=is_spec),
        P(), P(), P(), _history_specs(plan, history))


def _history_specs(plan, history):
    """Where fp8-delayed's histories live: split over pp with their layers, replicated
    otherwise (jaxscale.model.fp8_history); None without them."""
    if history is None:
        return None
    layers = P(PP) if plan.pp > 1 else P()
    return {"blocks": jax.tree.map(lambda _: layers, history["blocks"]),
            **({"head": P()} if "head" in history else {})}


def _init(plan, optimizer, pol, layout, mesh, specs, state_specs, order):
    """init(params32) -> the state on the mesh: the blocks' layers in the schedule's order,
    each device's optimizer copy made from its own shards (ZeRO: its dp slice of them)."""
    def local_state(params):
        return steplib.init_state(params, optimizer, pol,
                                  arrange=layout.owned if plan.zero_stage else None,
                                  arrange_params=plan.zero_stage == 3)

    make = jax.jit(jax.shard_map(local_state, mesh=mesh, in_specs=(specs,),
                                 out_specs=state_specs))
    placement = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=is_spec)

    def init(params32):  # (a stack of interleaved blocks is never reordered: pp=1)
        blocks = params32["blocks"] if list(order) == sorted(order) else jax.tree.map(
            lambda x: x[jnp.asarray(order)], params32["blocks"])
        return make(jax.device_put({**params32, "blocks": blocks}, placement))
    return init
