"""Tensor, pipeline, context and data parallelism together: one shard_map over the
(dp, pp, cp, tp) mesh.

Where each parameter lives follows from its logical axis names (jaxscale.model.transformer), by rules:

    heads -> tp    Q, K, V split by output heads, O by input heads        (Megatron)
    mlp   -> tp    W1 split by output columns, W2 by input rows           (Megatron)
    layers -> pp   each pipeline stage holds its own layers
    anything else  replicated: embeddings, LayerNorms, output biases

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

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxscale.model import transformer as modellib, precision
from jaxscale.parallel import context
from jaxscale.parallel.canonical import Canonical, param_infos
from jaxscale.parallel.data_parallel import (AXIS, ShardedStep, accumulated_value_and_grad,
    shard_step)
from jaxscale.parallel.pipeline import pipeline_value_and_grad, tick_table, vary
from jaxscale.parallel.zero import (ZeroLayout, check_elementwise, forward_gathered,
                                    gathered_units)
from jaxscale.runtime import mesh as meshlib
from jaxscale.model.config import ModelConfig
from jaxscale.model.loss import logits_nll_and_count
from jaxscale.parallel.plan import PlanError
from jaxscale.parallel import layouts
from jaxscale.parallel import step as steplib

RULES = {"heads": "tp", "mlp": "tp", "layers": "pp"}


def param_specs(axes, plan):
    """PartitionSpec of every parameter from its logical axes (axes of size-1 mesh dims
    are left out, so a tp=1 plan does not mention tp)."""
    live = {name: mesh for name, mesh in RULES.items() if getattr(plan, mesh) > 1}
    return jax.tree.map(lambda names: P(*(live.get(n) for n in names)), axes,
                        is_leaf=lambda x: isinstance(x, tuple))


def layer_order(n_layers: int, pp: int, v: int) -> list[int]:
    """Interleaving: device s holds virtual stages s, s+p, ..., so the stacked layer axis
    is reordered such that each device's contiguous share is its chunks in order."""
    per = n_layers // (pp * v)
    return [(c * pp + s) * per + i for s in range(pp) for c in range(v) for i in range(per)]


def _reorder(x, info, perm):
    """A stacked (block) tensor's layers in the order `perm` (None: as they are)."""
    return x[jnp.asarray(perm)] if info.stacked and perm is not None else x


class HybridCanonical:
    """The canonical form of the tp/pp layouts: whole tensors sharded as the plan shards the
    parameters (`canonical_spec`: a restore reads each device's shard straight from disk),
    with the blocks' layers permuted back from the interleaved order (`layer_order`)."""

    def __init__(self, order):
        identity = list(order) == sorted(order)
        self.order = None if identity else list(order)
        self.inverse = None if identity else [order.index(i) for i in range(len(order))]

    def canonical_spec(self, info):
        return P(*info.spec)

    def params_to_canonical(self, x, info):
        return _reorder(x, info, self.inverse)

    def params_from_canonical(self, x, info):
        return _reorder(x, info, self.order)


class MeshLayout(HybridCanonical, layouts.Replicated):
    """The optimizer works on each device's shards; reductions know which axes split what."""

    def __init__(self, specs, axes, order):
        HybridCanonical.__init__(self, order)
        self.specs, self.axes = specs, axes  # axes: the mesh axes of size > 1 besides dp

    def copy_to_canonical(self, x, info):  # the optimizer's copy is sharded like the params
        return self.params_to_canonical(x, info)

    def copy_from_canonical(self, x, info):
        return self.params_from_canonical(x, info)

    def all_finite(self, flag):
        if not self.axes:
            return flag
        return lax.pmin(vary(flag.astype(jnp.int32), self.axes), self.axes).astype(bool)

    def global_sum(self, x):  # counts a replicated parameter once per copy (a diagnostic)
        return lax.psum(vary(x, self.axes), self.axes) if self.axes else x

    def norm(self, tree):
        def sq(g, spec):  # a shard's sum of squares, summed over the axes that split it
            split = tuple(a for a in spec if a is not None)
            s = jnp.sum(jnp.square(g))
            return lax.psum(s, split) if split else s
        return jnp.sqrt(sum(jax.tree.leaves(jax.tree.map(sq, tree, self.specs))))


class ZeroMeshLayout(HybridCanonical, ZeroLayout):
    """ZeRO over dp on each device's tp/pp shards (`shapes`: the LOCAL shard shapes): the
    2-D FSDP x TP layout.

    The optimizer's copy of a tensor (stage 3: the parameters too) is, on each device, a
    dp slice of its own tp/pp shard flattened and padded. The canonical conversion undoes that on each device's shard:
    gather the dp slices, drop the padding, reshape (and the reverse on restore); what is
    left is a whole tensor sharded as the plan shards the parameters.
    """

    def __init__(self, local_shapes, dp: int, specs, axes, order, mesh, stage: int = 1):
        ZeroLayout.__init__(self, local_shapes, dp, stage)
        HybridCanonical.__init__(self, order)
        self.specs, self.axes, self.mesh = specs, axes, mesh

    def params_to_canonical(self, x, info):  # stage 3 stores the parameters as slices too
        return self.copy_to_canonical(x, info) if self.stage == 3 else \
            HybridCanonical.params_to_canonical(self, x, info)

    def params_from_canonical(self, x, info):
        return self.copy_from_canonical(x, info) if self.stage == 3 else \
            HybridCanonical.params_from_canonical(self, x, info)

    def _local_shape(self, info):
        spec = info.spec + (None,) * (len(info.shape) - len(info.spec))
        return tuple(d // (self.mesh.shape[a] if a else 1) for d, a in zip(info.shape, spec))

    def copy_to_canonical(self, f, info):
        shape = self._local_shape(info)

        def shard(s):  # my dp slice of my shard's flat copy -> my whole shard
            flat = lax.all_gather(s, AXIS, axis=s.ndim - 1, tiled=True, to="invarying")
            return self.whole(flat, shape)
        x = jax.shard_map(shard, mesh=self.mesh, in_specs=_flat_spec(P(*info.spec), info.stacked),
                          out_specs=P(*info.spec))(f)
        return HybridCanonical.params_to_canonical(self, x, info)

    def copy_from_canonical(self, x, info):
        def shard(w):  # my whole shard -> my dp slice of its flat copy
            flat = self.flat(w, info.stacked)
            c = flat.shape[-1] // self.k
            return lax.dynamic_slice_in_dim(flat, lax.axis_index(AXIS) * c, c, axis=-1)
        return jax.shard_map(shard, mesh=self.mesh, in_specs=P(*info.spec),
                             out_specs=_flat_spec(P(*info.spec), info.stacked))(
            HybridCanonical.params_from_canonical(self, x, info))

    def all_finite(self, flag):
        axes = (AXIS, *self.axes)
        return lax.pmin(vary(flag.astype(jnp.int32), axes), axes).astype(bool)

    def global_sum(self, x):
        axes = (AXIS, *self.axes)
        return lax.psum(vary(x, axes), axes)

    def norm(self, tree):
        def sq(g, spec):  # a dp slice of a shard: sum over dp and over the shard's axes
            return lax.psum(jnp.sum(jnp.square(g)), (AXIS, *(a for a in spec if a)))
        return jnp.sqrt(sum(jax.tree.leaves(jax.tree.map(sq, tree, self.specs))))


def _flat_spec(spec: P, stacked: bool) -> P:
    """Where a ZeRO-flattened leaf lives: [L, tp x dp x c] or [tp x dp x c]."""
    split = tuple(a for a in (spec[1:] if stacked else spec) if a) + (AXIS,)
    return P(spec[0], split) if stacked else P(split)


def _local_shapes(shapes, specs, plan):
    def local(s, spec):
        dims = [d // (getattr(plan, a) if a else 1) for d, a in
                zip(s.shape, tuple(spec) + (None,) * (len(s.shape) - len(spec)))]
        return jax.ShapeDtypeStruct(tuple(dims), s.dtype)
    return jax.tree.map(local, shapes, specs, is_leaf=lambda x: isinstance(x, P))


def check_divisible(cfg: ModelConfig, plan) -> None:
    """Refuse a plan whose tp, pp x virtual, cp or sp does not divide the model's shape."""
    v = plan.virtual
    if cfg.n_heads % plan.tp or cfg.d_ff % plan.tp:
        raise PlanError(f"tp={plan.tp} must divide the heads ({cfg.n_heads}) and the MLP "
                        f"width ({cfg.d_ff}); choose tp from "
                        f"{[k for k in range(1, cfg.n_heads + 1) if cfg.n_heads % k == 0 and cfg.d_ff % k == 0]}")
    if cfg.n_layers % (plan.pp * v):
        fits = [k for k in range(1, cfg.n_layers + 1) if cfg.n_layers % (k * v) == 0]
        raise PlanError(f"pp x virtual = {plan.pp} x {v} must divide the {cfg.n_layers} layers; "
                        f"with virtual={v} choose pp from {fits}")
    if plan.cp > 1:
        try:
            context.check_layout(cfg.seq_len, plan.cp)
        except context.ContextError as e:
            raise PlanError(str(e)) from None
    if plan.sequence_parallel and (cfg.seq_len // plan.cp) % plan.tp:
        raise PlanError(f"sequence parallelism splits each device's {cfg.seq_len // plan.cp} "
                        f"tokens (seq_len {cfg.seq_len} / cp {plan.cp}) over tp={plan.tp}, "
                        "which does not divide them; choose tp dividing "
                        f"{cfg.seq_len // plan.cp}")


def build_hybrid(model_cfg, graphdef, plan, optimizer: optax.GradientTransformation,
                 pol: precision.Policy, shapes, axes, devices=None):
    """(init, step) for a plan with tp > 1 or pp > 1 (and any dp)."""
    check_divisible(model_cfg, plan)
    devices = list(jax.devices() if devices is None else devices)[:plan.n_devices]
    mesh = meshlib.make_mesh(plan.mesh_shape, devices)
    specs = param_specs(axes, plan)
    tp_axis = "tp" if plan.tp > 1 else None
    v = plan.virtual
    order = layer_order(model_cfg.n_layers, plan.pp, v)

    def arrange(tree, perm=order):
        return {**tree, "blocks": jax.tree.map(lambda x: x[jnp.asarray(perm)], tree["blocks"])}

    axes = tuple(a for a in ("pp", "tp") if getattr(plan, a) > 1)
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    check_elementwise(jax.eval_shape(optimizer.init, shapes), shapes,
                      who="tensor/pipeline parallelism")
    if plan.zero_stage:
        layout = ZeroMeshLayout(_local_shapes(shapes, specs, plan), plan.dp, specs, axes,
                                order, mesh, plan.zero_stage)
        reduce_dp = lambda g: jax.tree.map(  # noqa: E731  the reduce-scatter to my slice
            lambda f: lax.psum_scatter(f, AXIS, scatter_dimension=f.ndim - 1, tiled=True),
            layout.flatten(g))
        flat_specs = jax.tree_util.tree_map_with_path(
            lambda path, sp: _flat_spec(sp, getattr(path[0], "key", None) == "blocks"),
            specs, is_leaf=is_spec)
    else:
        layout, flat_specs = MeshLayout(specs, axes, order), specs
        reduce_dp = lambda g: jax.tree.map(lambda x: lax.psum(x, AXIS), g)  # noqa: E731
    identity = lambda tree: tree  # noqa: E731
    # stage 2 reduce-scatters every micro-batch's gradients (or, in a pipeline, every
    # backward tick's) as they come; stage 3's arrive scattered (the gathers' transposes)
    per_micro = reduce_dp if plan.zero_stage == 2 else identity
    after = identity if plan.zero_stage in (2, 3) else reduce_dp
    if plan.pp > 1:
        shared = jax.tree.map(lambda s: "pp" not in s, specs, is_leaf=is_spec)
        grad_fn = pipeline_value_and_grad(plan, tick_table(plan.schedule, plan.pp,
                                                           plan.micro_batches, v),
                                          tp_axis=tp_axis, replicated_over_pp=shared,
                                          dp_reduce=after, per_tick=per_micro,
                                          like=layout.owned if plan.zero_stage == 2 else None,
                                          units=gathered_units(layout.fetch, plan.remat,
                                                               plan.attention, plan.unroll,
                                                               tp_axis)
                                          if plan.zero_stage == 3 else None,
                                          d_model=model_cfg.d_model)
        seq_axes = ()
    else:
        # the axes that split the sequence: cp (a ring), tp when sequence parallel
        seq_axes = tuple(a for a, on in ((context.AXIS, plan.cp > 1),
                                         ("tp", plan.sequence_parallel)) if on)
        sp = plan.tp if plan.sequence_parallel else 1

        def sequence(mb):
            return (context.sequence(mb, plan.cp, sp=sp) if seq_axes
                    else modellib.sequence(model_cfg, mb["tokens"]))

        def nll(prm, mb):
            if plan.zero_stage == 3:  # prm: my dp slices of my tp shards, gathered per unit
                logits = forward_gathered(prm, mb["tokens"], plan.remat, layout.fetch,
                                          plan.attention, plan.unroll, tp_axis, sequence(mb))
            else:
                logits = modellib.forward(prm, mb["tokens"], plan.remat, tp_axis=tp_axis,
                                          attention=plan.attention, unroll=plan.unroll,
                                          seq=sequence(mb))
            return logits_nll_and_count(logits, mb)

        # The devices that split the sequence hold different tokens, so each parameter's
        # gradient has a share on each: summed over cp, and over tp (sequence parallel)
        # for the parameters tp does not split, after dp's reduction (ZeRO: on slices).
        # Each device differentiates its own copy over dp and those axes (ZeRO-3: its
        # slices are its own over dp already); otherwise autodiff would sum the shares
        # over tp itself, once per use (the tied embedding: twice).
        def over_sequence(g):
            def one(x, spec):
                axes = tuple(a for a in seq_axes if a != "tp" or "tp" not in spec)
                return lax.psum(x, axes) if axes else x
            return jax.tree.map(one, g, specs, is_leaf=is_spec) if seq_axes else g

        mine = ((AXIS,) if plan.zero_stage != 3 else ()) + seq_axes
        grad_fn = accumulated_value_and_grad(
            nll, plan.micro_batches, per_micro=per_micro,
            after=lambda g: over_sequence(after(g)),
            like=layout.owned if plan.zero_stage == 2 else identity,
            own=lambda p: jax.tree.map(lambda x: vary(x, mine), p) if mine else p,
            batch_axes=(AXIS, *seq_axes))
    update = steplib.make_step(graphdef, optimizer, pol, jit=False, layout=layout,
                                 grad_fn=grad_fn)
    state_specs = steplib.TrainState(
        flat_specs if plan.zero_stage == 3 else specs,
        None if not pol.master_weights else flat_specs,
        optax.tree_map_params(optimizer, lambda _, s: s, jax.eval_shape(optimizer.init, shapes),
                              flat_specs, transform_non_params=lambda _: P(), is_leaf=is_spec),
        P(), P(), P())

    def local_state(params):  # on each device's own shards (ZeRO: its dp slice of them)
        return steplib.init_state(params, optimizer, pol,
                                    arrange=layout.owned if plan.zero_stage else None,
                                    arrange_params=plan.zero_stage == 3)

    make = jax.jit(jax.shard_map(local_state, mesh=mesh, in_specs=(specs,),
                                 out_specs=state_specs))

    def init(params32):
        placed = jax.device_put(arrange(params32), jax.tree.map(
            lambda s: NamedSharding(mesh, s), specs, is_leaf=is_spec))
        return make(placed)

    if seq_axes:  # whole rows arrive on dp: reordered for the ring, split
        compiled, guarded = shard_step(
            update, mesh, state_specs, batch_spec=P(AXIS, seq_axes),
            prepare=lambda b: context.prepare(b, plan.cp, document_mask=model_cfg.document_mask))
    else:
        compiled, guarded = shard_step(update, mesh, state_specs)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), state_specs, is_leaf=is_spec)
    infos = param_infos(shapes, specs)
    return init, ShardedStep(mesh, compiled,  # whole parameters in the model's layer order
                             jax.jit(lambda state: jax.tree.map(layout.params_to_canonical,
                                                                state.params, infos)),
                             Canonical(layout, optimizer, pol, shapes, mesh, shardings, specs),
                             guarded)
