"""Context parallelism: the sequence split over a `cp` mesh axis, attention run as a ring.

Everything in a transformer block but attention treats tokens one at a time, so a device
holding T/cp of every row's tokens can run the embeddings, LayerNorms, MLP and loss on
its own share. Attention needs every earlier key and value. Ring attention (Liu et al.
2023) keeps each device's queries where they are and passes the key/value blocks round
the ring, cp - 1 hops:

    o, l, m = 0, 0, -inf                       # output, softmax sum, running max per query
    for j in range(cp):                        # the block that came from device me - j
        s = q k_j^T / sqrt(d), masked          # causal (by global position) and document
        m' = max(m, rowmax s);  c = exp(m - m')
        l = c l + rowsum exp(s - m');  o = c o + exp(s - m') v_j;  m = m'
        if j < cp - 1: (k, v) <- ppermute from the previous device
    out = o / l                                # the online softmax: exact, not approximate

Bytes: each hop sends this device's k and v blocks, 2·B·(T/cp)·d values, so a layer's
forward sends (cp - 1)·2·B·(T/cp)·d per device; backward sends the same again as the
gradients of k and v travel back (the transpose of ppermute is the reverse ppermute).

Causal load balance. With contiguous shares, device cp - 1's queries see every block and
device 0's only its own: the others' blocks are all masked, so device 0 idles while the
last computes cp blocks. The zig-zag layout (Megatron-LM's and torchtitan's load-balanced
CP) cuts the sequence into 2·cp chunks and gives device i chunks i and 2cp-1-i: an early
and a late one. At every hop j > 0 exactly half of the block pairs are live: from a
lower device (src < me) all my queries see the first half of its keys; from a higher one
only my second chunk sees its keys, all of them. Each device computes the same work
(`ring_work` counts it, from the same branches the program takes).

The layouts are data: `sequence_order` is the order of the global positions as the
devices hold them; the host permutes every [B, T] array of a batch by it before placing
the rows on (dp, cp), and the loss (a sum over tokens) does not care about the order.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax.ad_checkpoint import checkpoint_name

from jaxscale.model import attention as attentionlib
from jaxscale.parallel.axes import CP
from jaxscale.model.transformer import document_ids
from jaxscale.runtime.vma import COLLECTIVE, vary, varying_axes

LAYOUTS = ("zigzag", "contiguous")


class ContextError(ValueError):
    """A context-parallel layout does not fit the sequence."""


def chunks_per_device(layout: str) -> int:
    return 2 if layout == "zigzag" else 1


def check_layout(seq_len: int, cp: int, layout: str = "zigzag") -> None:
    """Raise ContextError unless `layout` is known and cp (2·cp for zig-zag) divides seq_len."""
    if layout not in LAYOUTS:
        raise ContextError(f"unknown context-parallel layout {layout!r}; choose from "
                           f"{', '.join(LAYOUTS)}")
    parts = cp * chunks_per_device(layout)
    if seq_len % parts:
        fits = [c for c in range(1, seq_len + 1) if seq_len % (c * chunks_per_device(layout)) == 0]
        raise ContextError(
            f"cp={cp} with the {layout} layout cuts the sequence into {parts} equal chunks, "
            f"but seq_len={seq_len} is not divisible by {parts}; choose cp from "
            f"{', '.join(map(str, fits[:12]))}")


def sequence_order(seq_len: int, cp: int, layout: str = "zigzag") -> np.ndarray:
    """The global positions in the order the devices hold them: device i holds entries
    [i·T/cp, (i+1)·T/cp) (zig-zag: chunks i and 2cp-1-i of 2cp)."""
    check_layout(seq_len, cp, layout)
    if layout == "contiguous":
        return np.arange(seq_len)
    chunks = np.arange(seq_len).reshape(2 * cp, -1)
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * cp - 1 - i]])
                           for i in range(cp)])


def to_device_order(batch: dict, cp: int, layout: str) -> dict:
    """Every [B, T] array of a host batch with its T axis in `sequence_order`."""
    order = sequence_order(next(iter(batch.values())).shape[1], cp, layout)
    return {k: np.take(np.asarray(v), order, axis=1) for k, v in batch.items()}


class SequenceShard:
    """What the model needs inside shard_map to run on one device's share of every row
    (its `seq` argument): the global positions of its tokens (for the position
    embeddings) and `attend`. The sequence is split over `cp` (ring attention) and, with
    sequence parallelism, each cp share again over `tp` between the sub-layers (attention
    sees the cp share whole: jaxscale.model.transformer.block gathers it). `segments`: every token's
    document id, all devices' shares in device order ([B, T], gathered once per step), or
    None (no document mask)."""

    def __init__(self, seq_len: int, cp: int = 1, layout: str = "zigzag", segments=None,
                 sp: int = 1, axis: str = CP, sp_axis: str = "tp"):
        self.cp, self.sp, self.layout, self.segments = cp, sp, layout, segments
        self.axis, self.sp_axis = axis, sp_axis
        self.sequence_parallel = sp > 1
        self.table = sequence_order(seq_len, cp, layout).reshape(cp, -1)  # [cp, T/cp]

    def positions(self, t: int) -> jax.Array:
        """The global positions of this device's t tokens: its cp share (what attention
        sees), or with sequence parallelism between sub-layers its tp part of that share."""
        share = jnp.asarray(self.table)[lax.axis_index(self.axis) if self.cp > 1 else 0]
        if self.sp > 1 and t != share.shape[0]:
            share = share.reshape(self.sp, -1)[lax.axis_index(self.sp_axis)]
        assert share.shape == (t,), (share.shape, t)
        return share

    def attend(self, q, k, v, kernel: str = "einsum"):
        if self.cp == 1:  # whole rows (sequence parallel gathered them): any kernel
            return attentionlib.attend(q, k, v, kernel, self.segments)
        # the ring is its own kernel: its blocks are einsums
        return ring_attention(q, k, v, self.table, self.segments, self.axis, self.layout)[0]


def ring_attention(q, k, v, table, segments, axis: str, layout: str):
    """(attention output, score pairs computed) for this device's q, k [B, t, H, K] and
    v [B, t, H, V] (V = K but for latent attention's values; see the module docstring). `table` [cp, t]: global positions of every device's tokens."""
    cp, t = table.shape
    me = lax.axis_index(axis)
    positions = jnp.asarray(table)

    def seg(src):
        return None if segments is None else lax.dynamic_slice_in_dim(segments, src * t, t, 1)

    b, _, h, _ = q.shape
    acc = Online(jnp.full((b, h, t), -jnp.inf, jnp.float32), jnp.zeros((b, h, t), jnp.float32),
                 jnp.zeros((*q.shape[:3], v.shape[-1]), jnp.float32), jnp.float32(0))
    acc = jax.tree.map(lambda x: _vary_like(x, q), acc)
    qpos, qseg = positions[me], seg(me)
    ring = [(i, (i + 1) % cp) for i in range(cp)]
    for j in range(cp):
        src = (me - j) % cp
        kpos, kseg = positions[src], seg(src)
        if j == 0:  # my own block: causal inside it
            acc = acc.update(q, k, v, qpos, kpos, qseg, kseg)
        elif layout == "zigzag":
            c = t // 2
            first = lambda a, k=k, v=v, kpos=kpos, kseg=kseg: a.update(  # noqa: E731
                q, k[:, :c], v[:, :c], qpos, kpos[:c], qseg, _half(kseg, 0, c))
            second = lambda a, k=k, v=v, kpos=kpos, kseg=kseg: a.rows(c).update(  # noqa: E731
                q[:, c:], k, v, qpos[c:], kpos, _half(qseg, c, t), kseg).into(a, c)
            acc = lax.cond(src < me, first, second, acc)
        else:  # contiguous: a block from a lower device is all visible, a higher one none
            full = lambda a, k=k, v=v, kpos=kpos, kseg=kseg: a.update(  # noqa: E731
                q, k, v, qpos, kpos, qseg, kseg)
            acc = lax.cond(src < me, full, lambda a: a, acc)
        if j < cp - 1:  # the next block: from the previous device, mine to the next
            k, v = checkpoint_name(lax.ppermute((k, v), axis, ring), COLLECTIVE)
    return (acc.o / jnp.swapaxes(acc.l, 1, 2)[..., None]).astype(q.dtype), acc.pairs


def _half(x, lo, hi):
    return None if x is None else x[:, lo:hi]


def _vary_like(x, like):
    return vary(x, tuple(sorted(varying_axes(like))))


@jax.tree_util.register_pytree_node_class
class Online:
    """The online softmax's running state for a set of query rows: max m and sum l per
    (row, head) [B, H, t], output o [B, t, H, K] (all fp32), and the score pairs counted."""

    def __init__(self, m, l, o, pairs):  # noqa: E741
        self.m, self.l, self.o, self.pairs = m, l, o, pairs

    def tree_flatten(self):
        return (self.m, self.l, self.o, self.pairs), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)

    def rows(self, lo: int) -> "Online":
        return Online(self.m[..., lo:], self.l[..., lo:], self.o[:, lo:], self.pairs)

    def into(self, whole: "Online", lo: int) -> "Online":
        return Online(whole.m.at[..., lo:].set(self.m), whole.l.at[..., lo:].set(self.l),
                      whole.o.at[:, lo:].set(self.o), self.pairs)

    def update(self, q, k, v, qpos, kpos, qseg, kseg) -> "Online":
        """Fold the block (k, v) into the running softmax of queries q (k and v travel the
        ring with their own heads, fewer under grouped-query attention: repeated here)."""
        k, v = attentionlib.repeat_kv(k, q.shape[2]), attentionlib.repeat_kv(v, q.shape[2])
        s = jnp.einsum("bqhk,bshk->bhqs", q, k).astype(jnp.float32) / math.sqrt(q.shape[-1])
        allowed = (kpos[None, :] <= qpos[:, None])[None, None]  # [1, 1, q, s]
        if qseg is not None:
            allowed = allowed & (qseg[:, :, None] == kseg[:, None, :])[:, None]
        # the result does not depend on the running max (it cancels between o and l): it is
        # a constant to autodiff; a row that has seen no key yet keeps m = -inf and shifts
        # by 0 instead
        m_new = lax.stop_gradient(
            jnp.maximum(self.m, jnp.max(jnp.where(allowed, s, -jnp.inf), axis=-1)))
        shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.where(allowed, jnp.exp(s - shift[..., None]), 0.0)
        scale = jnp.exp(self.m - shift)  # exp(-inf) = 0 where nothing was seen
        o = (self.o * jnp.swapaxes(scale, 1, 2)[..., None]
             + jnp.einsum("bhqs,bshk->bqhk", p.astype(v.dtype), v).astype(jnp.float32))
        pairs = self.pairs + q.shape[1] * k.shape[1]
        return Online(m_new, self.l * scale + p.sum(-1), o, pairs)


def ring_work(cp: int, layout: str, t: int) -> list[int]:
    """Score pairs (query x key) each device computes per row and head under `layout`, from
    the same branch choice the program makes (src < me), for local length t."""
    c = t // 2
    work = []
    for me in range(cp):
        n = t * t
        for j in range(1, cp):
            src = (me - j) % cp
            if layout == "zigzag":
                n += t * c  # either branch: t queries x c keys, or c queries x t keys
            elif src < me:
                n += t * t
        work.append(n)
    return work


def bytes_per_layer(batch: int, seq_len: int, d_model: int, cp: int, itemsize: int = 4) -> int:
    """Bytes one device sends per layer forward: cp - 1 hops of its k and v blocks."""
    return (cp - 1) * 2 * batch * (seq_len // cp) * d_model * itemsize


def prepare(batch: dict, cp: int, layout: str = "zigzag", document_mask: bool = False) -> dict:
    """The step's batch (whole rows, under jit) made ready for the ring: each token's
    document id added when attention is masked to documents (computed on whole rows,
    before the split), then every [B, T] array in `sequence_order`."""
    if document_mask:
        batch = {**batch, "segments": document_ids(batch["tokens"])}
    if cp == 1:
        return batch
    order = jnp.asarray(sequence_order(batch["tokens"].shape[1], cp, layout))
    return {k: jnp.take(v, order, axis=1) for k, v in batch.items()}


def sequence(batch: dict, cp: int, layout: str = "zigzag", sp: int = 1, axis: str = CP,
             sp_axis: str = "tp") -> SequenceShard:
    """The model's `seq` for this device's share of a prepared batch (inside shard_map):
    the document ids of every device's tokens are gathered once, for the masks."""
    axes = tuple(a for a, n in ((axis, cp), (sp_axis, sp)) if n > 1)
    segments = batch.get("segments")
    if segments is not None:  # [B, t] -> [B, T] in device order: int32, T per row
        segments = lax.all_gather(segments, axes, axis=1, tiled=True)
    return SequenceShard(batch["tokens"].shape[1] * cp * sp, cp, layout, segments, sp, axis,
                         sp_axis)
