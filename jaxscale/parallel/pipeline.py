"""Pipeline parallelism over the `pp` mesh axis, for any schedule of jaxscale.parallel.schedules.

The layers are cut into p stages (p x v chunks when interleaved) and the batch into m
micro-batches. The schedule says, for each device, in which order it runs the forward (F)
and backward (B) of each (micro-batch, chunk). Here that order is executed for real:

1. `tick_table` (jaxscale.parallel.tick_table) turns the schedule into lockstep tables:
   what each device does at each tick, and in which slot each arriving activation or
   gradient waits until it is used.
2. `pipeline_value_and_grad` (inside shard_map) scans over the ticks. At every tick each
   device runs its own action under `lax.switch` (nothing, F or B), then two `ppermute`s
   (four when the chunks sit in a V, zbv)
   move the activation it produced to the next stage and the input gradient it produced to
   the previous one (a ring: with interleaving the last device feeds device 0's next chunk).
   F stores nothing but the stage's INPUT (in the slot); B recomputes the stage's forward
   from it with `jax.vjp` and applies the received gradient: stage-level recomputation,
   so a micro-batch in flight costs one activation of the stage input.
   A zero-bubble schedule splits B into the input gradient (B) and the weights' (W), two
   more branches of the switch (jaxscale.parallel.split_backward); B's results wait in a
   slot of their own until W.
The first virtual stage embeds the tokens, the last applies the head and the loss; every
stage runs the same program (SPMD), so the embedding and head are computed everywhere and
selected with `where`: simple, and cheap next to the blocks in real models.
A mixture of experts' routers add their objective to every chunk's backward (each router
learns on its own stage; a split backward: in B and in W), and their figures, summed over
the forward ticks, are joined over pp at the end (jaxscale.model.moe.over_stages).
Interleaved experts (every n-th block) reach each chunk in whole groups of n blocks. With ep, the rows are split over dp
and ep (`batch_axes`): the experts' all-to-alls run inside the F and B branches, where
every device of an ep group takes the same branch, as a stage's dp replicas do.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxscale.model import fp8_history, moe, stack, transformer as modellib
from jaxscale.model.config import GPT2, Family
from jaxscale.model.loss import logits_nll_and_count
from jaxscale.parallel.axes import DP, PP
from jaxscale.parallel.layouts import GradReduction
from jaxscale.parallel.split_backward import StageParts, input_gradient, weight_gradient
from jaxscale.parallel.step import with_router
from jaxscale.parallel.tick_accumulate import Accumulate, per_micro as _per_micro
from jaxscale.parallel.tick_table import TickTable
from jaxscale.runtime.vma import cotangent, vary, varying_axes, zeros_like

class Tick(NamedTuple):
    """One device's row of the tick table: what it does at this tick and where its data
    waits (see TickTable)."""

    kind: jax.Array  # IDLE, FORWARD, BACKWARD or WEIGHT
    micro: jax.Array
    chunk: jax.Array
    slot: jax.Array
    gslot: jax.Array
    recv: jax.Array
    grecv: jax.Array
    wslot: jax.Array | None = None  # a split backward's: where B's results wait for W
    recv2: jax.Array | None = None  # chunks in a V: the other neighbour's arrivals and the
    grecv2: jax.Array | None = None  # device's own (see TickTable)
    keep: jax.Array | None = None
    gkeep: jax.Array | None = None


def pipeline_value_and_grad(plan, table: TickTable, *, reduction: GradReduction,
                            replicated_over_pp, pp_axis=PP, dp_axis=DP, tp_axis=None,
                            units=None, d_model=None, family: Family = GPT2,
                            batch_axes=(DP,), experts: bool = False):
    """grad_fn for steplib.make_step running the pipeline (see the module docstring).

    `params` arrive with the blocks' layer axis split over pp (this device's v chunks, in
    order) and everything else whole. Returns (global loss, gradients reduced over dp as
    the layout's `reduction` says, and summed over pp for the parameters every stage holds:
    embeddings and the final LayerNorm). With ZeRO-2 each backward tick's gradients are
    reduce-scattered at once (`reduction.per_micro`) and the accumulator holds only this
    device's slices: the dp replicas of a stage run the same ticks, so they meet in the
    same branch. `units`: (embed, layers, head) on this device's parameters (ZeRO-3: on
    its slices, each unit gathering what it uses: zero.gathered_units); default the
    model's own. `d_model`: the activations' width (default: the token embedding's).
    `family`: the model's (jaxscale.model.config.Family). `batch_axes`: the mesh axes
    that split the rows (dp, and ep with it). `experts`: the model has a mixture of
    experts (its routers' objective and figures, see the module docstring).
    """
    if table.split and units is not None:
        raise ValueError("a split backward runs the model's own units, not ZeRO-3's")
    units = _units(units, plan, tp_axis, family)
    p, m, v = plan.pp, plan.micro_batches, plan.virtual
    rows = Tick(*(None if getattr(table, f) is None else jnp.asarray(getattr(table, f))
                  for f in Tick._fields))
    last_device = 0 if table.vee else p - 1  # where the last virtual stage (the loss) is

    axes = (*batch_axes, pp_axis)  # what each device holds its own copy over

    def grad_fn(params, batch, multiplier, history=None):
        stage = lax.axis_index(pp_axis)
        count = lax.psum(jnp.sum(batch["mask"]), batch_axes)
        mbs = jax.tree.map(lambda x: x.reshape(m, x.shape[0] // m, *x.shape[1:]), batch)
        # every device differentiates its own copy, so autodiff inserts no dp or pp psum,
        # which inside lax.switch would wait for devices in another branch (tp's all-reduces
        # are fine there: a stage's tp group always takes the same branch)
        mine = jax.tree.map(lambda x: vary(x, axes), params)
        acc = Accumulate(history, (dp_axis, pp_axis))  # (and fp8-delayed's amaxes)
        per_chunk = stack.depth(params["blocks"]) // v  # blocks in a chunk
        fns = _Stage(units, stage, last_device, v, m, count)
        b, t = mbs["tokens"].shape[1:]
        d = d_model or params["tok_embed"].shape[-1]
        act = vary(jnp.zeros((b, t, d), params["tok_embed"].dtype), axes)
        ct, held = (jnp.float32(1.0) if multiplier is None else multiplier), ()
        if table.split:  # B's boundary activations and their gradients, waiting for W
            parts = StageParts(
                units[0], _split_block(tp_axis, plan.attention, family, m, experts),
                fns.head_loss, fns.blocks, None if plan.remat == "none"
                else modellib.REMAT_POLICIES[plan.remat], plan.unroll)
            branches = _split_branches(parts, fns.forward, stage, mine, last_device, v, m,
                                       reduction, ct, acc)
            held = (jnp.zeros((table.wslots, per_chunk + 1, *act.shape), act.dtype) + act,) * 2
        else:
            branches = _joint_branches(fns, mine, p, v, m, stage, reduction, ct, acc)
        # the routers' figures as a forward returns them (their shapes and the axes they
        # vary over: every branch of the switch returns the same), zero
        no_stats = jax.tree.map(zeros_like, jax.eval_shape(lambda: moe.per_micro(
            acc.model(fns.forward, mine, act, jax.tree.map(lambda x: x[0], mbs), 0)[2], 0,
            m))) if experts else {}
        carry = (jnp.zeros((table.slots, *act.shape), act.dtype) + act,
                 jnp.zeros((table.gslots, *act.shape), act.dtype) + act,
                 acc.zeros(reduction.accumulator(mine)),
                 zeros_like(act.sum()).astype(jnp.float32), no_stats, held)
        (_, _, out, loss, stats, _), _ = lax.scan(
            _tick_fn(branches, stage, mbs, p, pp_axis, table.vee, acc.add), carry, rows)
        grads, amaxes = acc.parts(out)
        grads = jax.tree.map(lambda g, shared: lax.psum(g, pp_axis) if shared else g,
                             reduction.per_step(grads), replicated_over_pp)
        loss = lax.psum(loss, axes)
        if stats:  # every chunk's figures, m of each
            loss = with_router(loss, moe.over_stages(stats, pp_axis, p * v, m), batch_axes)
        return acc.outputs(loss, grads, amaxes)

    return grad_fn


def _units(units, plan, tp_axis, family):
    """(embed, layers, head) of a stage: ZeRO-3's `units` or the model's own, their layers
    returning the routers' figures beside the activations ({} for dense blocks)."""
    if units is not None:
        embed, layers, head = units
        return embed, lambda blocks, h: layers(blocks, h, stats=True), head
    return (lambda prm, tokens: modellib.embed(prm, tokens, family=family),
            lambda blocks, h: modellib.layers_with_stats(
                blocks, h, plan.remat, tp_axis, attention=plan.attention, unroll=plan.unroll,
                family=family),
            lambda prm, h: modellib.head(prm, h, family))


class _Stage:
    """One device's share of the model inside the step: its chunks of the blocks, the
    head's loss (first stage embeds, last applies the head: selected with `where`), the
    forward of a chunk, and what a backward differentiates."""

    def __init__(self, units, stage, last_device, v, m, count):
        self.units, self.stage, self.last_device = units, stage, last_device
        self.v, self.m, self.count = v, m, count

    def blocks(self, blocks, chunk):
        """The chunk's share of each stacked entry: 1/v of its layer axis (interleaved
        experts: whole groups, so the dense MLP's and the experts' stacks are shorter)."""
        def share(b):
            size = b.shape[0] // self.v
            return lax.dynamic_slice_in_dim(b, chunk * size, size)
        return jax.tree.map(share, blocks)

    def head_loss(self, prm, h, mb):
        return logits_nll_and_count(self.units[2](prm, h), mb)[0] / self.count

    def forward(self, prm, x, mb, chunk):  # prm: with the histories attached, if any
        """(the chunk's output, its share of the loss, the routers' figures)"""
        first = (self.stage == 0) & (chunk == 0)
        last = (self.stage == self.last_device) & (chunk == self.v - 1)
        h = jnp.where(first, self.units[0](prm, mb["tokens"]).astype(x.dtype), x)
        h, stats = self.units[1](self.blocks(prm["blocks"], chunk), h)
        return h, jnp.where(last, self.head_loss(prm, h, mb), 0.0), stats

    def trained(self, prm, x, mb, chunk):
        """(output, what a backward differentiates: the loss share, plus the routers'
        objective, a micro-batch's 1/m of it as in plain DP)"""
        h, loss, stats = self.forward(prm, x, mb, chunk)
        return h, loss + stats["objective"] / self.m if stats else loss


def _joint_branches(fns: _Stage, mine, p, v, m, stage, reduction, ct, acc):
    """idle, F and B for a schedule whose backward is one action: each returns (activation
    for the next stage, gradient for the previous, weight gradients (`acc`'s), loss, the
    routers' figures (F's; {} without experts), held ()). B differentiates fns.trained."""
    def branches(now, x, dy, mb, grads, loss, stats, held):
        last = (stage == p - 1) & (now.chunk == v - 1)  # its output feeds the loss
        dy = jnp.where(last, jnp.zeros_like(dy), dy)
        nothing = zeros_like(x), zeros_like(x), jax.tree.map(zeros_like, grads)
        no_stats = jax.tree.map(zeros_like, stats)

        def idle():
            return *nothing, zeros_like(loss), no_stats, held

        def forward():
            y, loss_j, seen = acc.model(fns.forward, mine, x, mb, now.chunk)
            return y, *nothing[1:], loss_j, moe.per_micro(seen, now.micro, m), held

        def backward():
            loss_j, vjp = acc.vjp(fns.trained, mine, x, mb, now.chunk)
            d_params, dx = vjp(dy, cotangent(ct, loss_j))
            d_params = acc.own_head(d_params, last)
            return (zeros_like(x), dx, _per_micro(reduction, d_params, acc), zeros_like(loss),
                    no_stats, held)

        return [idle, forward, backward]
    return branches


def _split_block(tp_axis, attention, family, m, experts: bool):
    """A split backward's block: (h, its router's objective / m); a dense block's, 0 in
    a model with experts (so interleaved blocks are alike), None in a dense model."""
    def block(p_l, h):
        h, stats = modellib.block_with_stats(p_l, h, tp_axis, attention, family=family)
        if stats:
            return h, stats["objective"] / m
        return h, vary(jnp.zeros((), jnp.float32), tuple(sorted(varying_axes(h)))) if experts else None
    return block


def _split_branches(parts, stage_fn, stage, mine, last_device, v, m, reduction, ct, acc):
    """idle, F, B (input gradient) and W (weights) for a zero-bubble schedule; B writes its
    boundary activations and gradients into `held` (slot now.wslot), W reads them there.
    Under fp8-delayed W reports the amaxes (it runs every product's backward again). A
    mixture of experts' routers: their objective in B and W (split_backward), their
    figures from F (as the joint backward's)."""
    def branches(now, x, dy, mb, grads, loss, stats, held):
        first = (stage == 0) & (now.chunk == 0)
        last = (stage == last_device) & (now.chunk == v - 1)
        nothing = zeros_like(x), zeros_like(x), jax.tree.map(zeros_like, grads)
        (hs, gs), zero = held, zeros_like(loss)
        no_stats = jax.tree.map(zeros_like, stats)

        def idle():
            return *nothing, zero, no_stats, held

        def forward():
            y, loss_j, seen = acc.model(stage_fn, mine, x, mb, now.chunk)
            return y, *nothing[1:], loss_j, moe.per_micro(seen, now.micro, m), held

        def backward():
            dx, h_new, g_new = input_gradient(parts, fp8_history.attach(mine, acc.seen), x, mb,
                                              first, last, now.chunk, dy, ct)
            return (nothing[0], dx, nothing[2], zero, no_stats,
                    (hs.at[now.wslot].set(h_new), gs.at[now.wslot].set(g_new)))

        def weight():
            d_params = weight_gradient(parts, mine, hs[now.wslot], gs[now.wslot], mb, first,
                                       last, now.chunk, ct, acc.seen)
            d_params = acc.own_head(d_params, last)
            return (*nothing[:2], _per_micro(reduction, d_params, acc), zero, no_stats,
                    held)

        return [idle, forward, backward, weight]
    return branches


def _tick_fn(branches, stage, mbs, p, pp_axis, vee=False, add=None):
    """The scan body: this device's action at one tick (one branch of lax.switch), then the
    activation it produced goes to the next stage and the input gradient to the previous
    one. Chunks in a loop: around the ring, one ppermute each way (with interleaving the
    last device feeds device 0's next chunk). In a V (zbv) the next stage is the next
    device on the way down, the previous one on the way up, or the device itself at the
    turn: each output is sent both ways, and each arrival is written where the receiver's
    tables say (-1: nowhere)."""
    ring = [(i, (i + 1) % p) for i in range(p)]
    back = [(b, a) for a, b in ring]

    def put(stash, slot, value):
        return jnp.where(slot >= 0, stash.at[jnp.maximum(slot, 0)].set(value), stash)

    def tick(carry, row):
        stash, gstash, grads, loss, stats, held = carry
        now = Tick(*(None if r is None else r[stage] for r in row))
        mb = jax.tree.map(lambda x: x[now.micro], mbs)
        y, dx, d_params, loss_j, stats_j, held = lax.switch(
            now.kind, branches(now, stash[now.slot], gstash[now.gslot], mb, grads, loss, stats,
                               held))
        stash = put(stash, now.recv, lax.ppermute(y, pp_axis, ring))  # from the previous
        gstash = put(gstash, now.grecv, lax.ppermute(dx, pp_axis, back))  # from the next
        if vee:
            stash = put(put(stash, now.recv2, lax.ppermute(y, pp_axis, back)), now.keep, y)
            gstash = put(put(gstash, now.grecv2, lax.ppermute(dx, pp_axis, ring)),
                         now.gkeep, dx)
        grads = jax.tree.map(jnp.add, grads, d_params) if add is None else add(grads, d_params)
        return (stash, gstash, grads, loss + loss_j, moe.add_statistics(stats, stats_j),
                held), None
    return tick
