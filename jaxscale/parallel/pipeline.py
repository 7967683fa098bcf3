"""Pipeline parallelism over the `pp` mesh axis, for any schedule of jaxscale.parallel.schedules.

The layers are cut into p stages (p x v chunks when interleaved) and the batch into m
micro-batches. The schedule says, for each device, in which order it runs the forward (F)
and backward (B) of each (micro-batch, chunk). Here that order is executed for real:

1. `tick_table` runs the schedule in the simulator with unit costs, so every action takes
   one tick, and turns it into tables [ticks, p]: what each device does at each tick, and
   in which buffer slot each arriving activation or gradient waits until it is used.
   Slots are reused as soon as they are free: GPipe needs m, 1F1B at most p.
2. `pipeline_value_and_grad` (inside shard_map) scans over the ticks. At every tick each
   device runs its own action under `lax.switch` (nothing, F or B), then two `ppermute`s
   move the activation it produced to the next stage and the input gradient it produced to
   the previous one (a ring: with interleaving the last device feeds device 0's next chunk).
   F stores nothing but the stage's INPUT (in the slot); B recomputes the stage's forward
   from it with `jax.vjp` and applies the received gradient: stage-level recomputation,
   so a micro-batch in flight costs one activation of the stage input.
The first virtual stage embeds the tokens, the last applies the head and the loss; every
stage runs the same program (SPMD), so the embedding and head are computed everywhere and
selected with `where`: simple, and cheap next to the blocks in real models.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxscale.model import transformer as modellib
from jaxscale.model.config import GPT2, Family
from jaxscale.model.loss import logits_nll_and_count
from jaxscale.parallel import schedules as sched
from jaxscale.parallel.axes import DP, PP
from jaxscale.parallel.layouts import GradReduction
from jaxscale.parallel.vma import vary, varying_axes, zeros_like

IDLE, FORWARD, BACKWARD = 0, 1, 2


@dataclass(frozen=True)
class TickTable:
    """A schedule as lockstep ticks; every array is [ticks, p] (device s reads column s)."""

    kind: np.ndarray  # IDLE, FORWARD or BACKWARD
    micro: np.ndarray  # micro-batch of the action
    chunk: np.ndarray  # chunk (virtual stage = chunk * p + device)
    slot: np.ndarray  # activation slot the action reads (its stage input)
    gslot: np.ndarray  # gradient slot a BACKWARD reads
    recv: np.ndarray  # activation slot an arriving activation is written to, -1 if none
    grecv: np.ndarray  # gradient slot an arriving gradient is written to, -1 if none
    slots: int
    gslots: int

    @property
    def ticks(self) -> int:
        return self.kind.shape[0]

    def branch_share(self) -> dict[int, float]:
        """Share of ticks a device spends idle, in F, in B (the same on every device: each
        runs every micro-batch's F and B once per chunk), i.e. how often each branch of the
        executor's lax.switch runs, for measure.collectives."""
        return {k: float(np.mean(self.kind[:, 0] == k)) for k in (IDLE, FORWARD, BACKWARD)}


def _assign(intervals: dict) -> tuple[dict, int]:
    """Slots for (key -> (write tick, read tick)) intervals on one device; a slot is free
    again from the tick it was last read (reads happen before that tick's writes)."""
    free_at, slot_of = [], {}
    for key, (start, end) in sorted(intervals.items(), key=lambda kv: kv[1]):
        for i, t in enumerate(free_at):
            if t <= start:
                free_at[i], slot_of[key] = end, i
                break
        else:
            free_at.append(end)
            slot_of[key] = len(free_at) - 1
    return slot_of, len(free_at)


def tick_table(schedule: str, p: int, m: int, v: int = 1) -> TickTable:
    """Compile `schedule` for p devices, m micro-batches, v chunks into lockstep tables."""
    timeline = sched.run(schedule, p, m, v, f_cost=v, b_cost=v)  # a chunk's F or B: 1 tick
    n_virtual = p * v
    when = {(a.kind, a.micro_batch, a.virtual_stage(p)): int(start)
            for row in timeline.rows for start, _, a in row}
    ticks = int(timeline.makespan)
    assert all(start.denominator == 1 for row in timeline.rows for start, _, _ in row)
    tables = {k: np.zeros((ticks, p), np.int32) for k in ("kind", "micro", "chunk", "slot",
                                                          "gslot")}
    recv, grecv = np.full((ticks, p), -1, np.int32), np.full((ticks, p), -1, np.int32)
    acts, grads = [{} for _ in range(p)], [{} for _ in range(p)]
    for (kind, j, k), t in when.items():
        if kind == "F" and k > 0:  # its input arrives at the end of F(j, k-1)'s tick
            acts[k % p][(j, k)] = (when["F", j, k - 1], when["B", j, k])
        if kind == "B" and k < n_virtual - 1:  # its gradient arrives after B(j, k+1)
            grads[k % p][(j, k)] = (when["B", j, k + 1], t)
    slot_maps = [_assign(a) for a in acts]
    gslot_maps = [_assign(g) for g in grads]
    for (kind, j, k), t in when.items():
        s = k % p
        tables["kind"][t, s] = FORWARD if kind == "F" else BACKWARD
        tables["micro"][t, s], tables["chunk"][t, s] = j, k // p
        tables["slot"][t, s] = slot_maps[s][0].get((j, k), 0)  # stage 0: input unused
        tables["gslot"][t, s] = gslot_maps[s][0].get((j, k), 0)  # last stage: unused
        if kind == "F" and k + 1 < n_virtual:
            recv[t, (k + 1) % p] = slot_maps[(k + 1) % p][0][(j, k + 1)]
        if kind == "B" and k > 0:
            grecv[t, (k - 1) % p] = gslot_maps[(k - 1) % p][0][(j, k - 1)]
    return TickTable(**tables, recv=recv, grecv=grecv,
                     slots=max(1, max(n for _, n in slot_maps)),
                     gslots=max(1, max(n for _, n in gslot_maps)))


class Tick(NamedTuple):
    """One device's row of the tick table: what it does at this tick and where its data
    waits (see TickTable)."""

    kind: jax.Array  # IDLE, FORWARD or BACKWARD
    micro: jax.Array
    chunk: jax.Array
    slot: jax.Array
    gslot: jax.Array
    recv: jax.Array
    grecv: jax.Array


def pipeline_value_and_grad(plan, table: TickTable, *, reduction: GradReduction,
                            replicated_over_pp, pp_axis=PP, dp_axis=DP, tp_axis=None,
                            units=None, d_model=None, family: Family = GPT2):
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
    `family`: the model's (jaxscale.model.config.Family).
    """
    embed, layers, head = units or (
        lambda prm, tokens: modellib.embed(prm, tokens, family=family),
        lambda blocks, h: modellib.layers(blocks, h, plan.remat, tp_axis,
                                          attention=plan.attention, unroll=plan.unroll,
                                          family=family),
        lambda prm, h: modellib.head(prm, h, family))
    p, m, v = plan.pp, plan.micro_batches, plan.virtual
    rows = Tick(*(jnp.asarray(getattr(table, f)) for f in Tick._fields))

    def grad_fn(params, batch, multiplier):
        stage = lax.axis_index(pp_axis)
        count = lax.psum(jnp.sum(batch["mask"]), dp_axis)
        mbs = jax.tree.map(lambda x: x.reshape(m, x.shape[0] // m, *x.shape[1:]), batch)
        # every device differentiates its own copy, so autodiff inserts no dp or pp psum,
        # which inside lax.switch would wait for devices in another branch (tp's all-reduces
        # are fine there: a stage's tp group always takes the same branch)
        mine = jax.tree.map(lambda x: vary(x, (dp_axis, pp_axis)), params)
        per_chunk = jax.tree.leaves(params["blocks"])[0].shape[0] // v

        def stage_fn(prm, x, mb, chunk):
            first, last = (stage == 0) & (chunk == 0), (stage == p - 1) & (chunk == v - 1)
            blocks = jax.tree.map(lambda b: lax.dynamic_slice_in_dim(b, chunk * per_chunk,
                                                                     per_chunk), prm["blocks"])
            h = jnp.where(first, embed(prm, mb["tokens"]).astype(x.dtype), x)
            h = layers(blocks, h)
            nll = logits_nll_and_count(head(prm, h), mb)[0] / count
            return h, jnp.where(last, nll, 0.0)

        tick = _tick_fn(stage_fn, stage, mine, mbs, p, v, pp_axis, reduction,
                        jnp.float32(1.0) if multiplier is None else multiplier)
        b, t = mbs["tokens"].shape[1:]
        d = d_model or params["tok_embed"].shape[-1]
        act = vary(jnp.zeros((b, t, d), params["tok_embed"].dtype), (dp_axis, pp_axis))
        carry = (jnp.zeros((table.slots, *act.shape), act.dtype) + act,
                 jnp.zeros((table.gslots, *act.shape), act.dtype) + act,
                 jax.tree.map(zeros_like, reduction.accumulator(mine)),
                 zeros_like(act.sum()).astype(jnp.float32))
        (_, _, grads, loss), _ = lax.scan(tick, carry, rows)
        grads = jax.tree.map(lambda g, shared: lax.psum(g, pp_axis) if shared else g,
                             reduction.per_step(grads), replicated_over_pp)
        return lax.psum(loss, (dp_axis, pp_axis)), grads

    return grad_fn


def _tick_fn(stage_fn, stage, mine, mbs, p, v, pp_axis, reduction, ct):
    """The scan body: this device's action at one tick (idle, F or B, under lax.switch),
    then the activation it produced goes to the next stage and the input gradient to the
    previous one (a ring: with interleaving the last device feeds device 0's next chunk)."""
    def tick(carry, row):
        stash, gstash, grads, loss = carry
        now = Tick(*(r[stage] for r in row))
        mb = jax.tree.map(lambda x: x[now.micro], mbs)
        x = stash[now.slot]
        last = (stage == p - 1) & (now.chunk == v - 1)  # its output feeds the loss, not a stage
        dy = jnp.where(last, jnp.zeros_like(gstash[now.gslot]), gstash[now.gslot])

        def idle():
            return zeros_like(x), zeros_like(x), jax.tree.map(zeros_like, grads), \
                zeros_like(loss)

        def forward():
            y, loss_j = stage_fn(mine, x, mb, now.chunk)
            return y, zeros_like(x), jax.tree.map(zeros_like, grads), loss_j

        def backward():
            (_, loss_j), vjp = jax.vjp(lambda prm, h: stage_fn(prm, h, mb, now.chunk), mine, x)
            d_params, dx = vjp((dy, vary(ct.astype(loss_j.dtype),
                                         tuple(sorted(varying_axes(loss_j))))))
            return zeros_like(x), dx, reduction.per_micro(d_params), zeros_like(loss)

        y, dx, d_params, loss_j = lax.switch(now.kind, [idle, forward, backward])
        ring = [(i, (i + 1) % p) for i in range(p)]
        y_in = lax.ppermute(y, pp_axis, ring)  # to the next stage
        dx_in = lax.ppermute(dx, pp_axis, [(b, a) for a, b in ring])  # to the previous
        stash = jnp.where(now.recv >= 0, stash.at[jnp.maximum(now.recv, 0)].set(y_in), stash)
        gstash = jnp.where(now.grecv >= 0,
                           gstash.at[jnp.maximum(now.grecv, 0)].set(dx_in), gstash)
        return (stash, gstash, jax.tree.map(jnp.add, grads, d_params), loss + loss_j), None
    return tick
