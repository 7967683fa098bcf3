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

from jaxscale.model import fp8_history, precision, transformer as modellib
from jaxscale.model.loss import logits_nll_and_count
from jaxscale.parallel import context, step as steplib
from jaxscale.parallel.axes import CP, DP, EP, PP, TP
from jaxscale.parallel.canonical import Canonical, param_infos
from jaxscale.parallel.step import PlanStep, shard_step
from jaxscale.parallel.data_parallel import accumulated_value_and_grad
from jaxscale.parallel.fits import check_divisible, splits_kv_heads
from jaxscale.parallel.mesh_layouts import (is_spec, layer_order, mesh_layout, reorder,
                                            state_flat_specs)
from jaxscale.parallel.pipeline import pipeline_value_and_grad
from jaxscale.parallel.schedules import VEE
from jaxscale.parallel.tick_table import tick_table
from jaxscale.runtime.vma import vary
from jaxscale.parallel.zero import check_elementwise, forward_gathered, gathered_units
from jaxscale.runtime import mesh as meshlib

RULES = {"heads": "tp", "kv_heads": "tp", "mlp": "tp", "layers": "pp", "experts": "ep"}


def param_specs(logical, plan, kv_heads: int = 0):
    """PartitionSpec of every parameter from its logical axes (axes of size-1 mesh dims
    are left out, so a tp=1 plan does not mention tp). `kv_heads`: the model's k/v heads
    where fewer than its query heads (their axis is "kv_heads")."""
    live = {name: mesh for name, mesh in RULES.items() if getattr(plan, mesh) > 1
            and (name != "kv_heads" or splits_kv_heads(kv_heads, plan.tp))}
    return jax.tree.map(lambda names: P(*(live.get(n) for n in names)), logical,
                        is_leaf=lambda x: isinstance(x, tuple))


def build_hybrid(model_cfg, graphdef, plan, optimizer: optax.GradientTransformation,
                 pol: precision.Policy, shapes, logical, devices=None):
    """(init, step) for a plan with tp, pp or cp > 1 (and any dp, any ZeRO stage):
    `shapes` the parameters' shapes, `logical` their logical axis names."""
    check_divisible(model_cfg, plan)
    devices = list(jax.devices() if devices is None else devices)[:plan.n_devices]
    mesh = meshlib.make_mesh(plan.mesh_shape, devices)
    specs = param_specs(logical, plan, model_cfg.kv_heads)
    order = layer_order(model_cfg.n_layers // model_cfg.moe_every, plan.pp, plan.virtual,
                        plan.schedule in VEE)  # (of groups, with interleaved experts)
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
    # with ep the rows are split over dp and ep: each device's share of what ep does not
    # split (all but the experts) summed over ep, after dp's reduction
    reduction = dataclasses.replace(layout.reduction(), then=_summed_over(specs, (EP,)))
    return pipeline_value_and_grad(
        plan, tick_table(plan.schedule, plan.pp, plan.micro_batches, plan.virtual),
        tp_axis=tp_axis, replicated_over_pp=shared, units=units,
        reduction=reduction if plan.ep > 1 else layout.reduction(),
        d_model=model_cfg.d_model, family=plan.family(model_cfg),
        batch_axes=(DP, EP) if plan.ep > 1 else (DP,), experts=bool(model_cfg.n_experts))


def _summed_over(specs, split):
    """A gradient tree's shares summed over the mesh axes `split` (those whose devices
    computed it on other tokens), for each parameter those axes do not split."""
    def one(x, spec):
        axes = tuple(a for a in split if a not in spec)
        return lax.psum(x, axes) if axes else x
    return lambda g: jax.tree.map(one, g, specs, is_leaf=is_spec) if split else g


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
    mine = ((DP,) if plan.zero_stage != 3 else ()) + split
    reduction = dataclasses.replace(
        layout.reduction(), then=_summed_over(specs, split),
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

    def init(params32):
        blocks = params32["blocks"] if list(order) == sorted(order) else jax.tree.map(
            lambda x: reorder(x, order), params32["blocks"])
        return make(jax.device_put({**params32, "blocks": blocks}, placement))
    return init
