"""The stack of blocks: every block's parameters stacked along a leading `layers` axis.

A forward pass walks the stack with one `lax.scan` (one loop body compiled, whatever the
depth). Every block of a dense model has the same entries, and so has every block of a
mixture of experts whose blocks all hold experts: the scan takes block i's slice of each.

Interleaved experts (ModelConfig.moe_every = n > 1: blocks n, 2n, ... hold the experts,
the rest the dense MLP) make two kinds of block. The stack keeps one entry per block for
what every block has (norms, attention), one per dense block for the dense MLP (w1, w2,
...: n_layers - n_layers / n of them) and one per expert block for `experts` (n_layers /
n). The scan then runs over groups of n blocks, each group n - 1 dense blocks and one
with experts, written out one after another inside the loop body:

    per-block entry  [L, ...]        -> [L/n, n, ...]
    dense MLP        [L - L/n, ...]  -> [L/n, n - 1, ...]
    experts          [L/n, ...]         (one per group)

DeepSeek's first dense blocks (ModelConfig.first_dense = k) make the other split: the
first k blocks hold the dense MLP, kept apart under `dense` ([k, ...] each), the rest the
experts ([L - k, ...]). The scan then runs twice, over the first k blocks and over the
others, each a stack of alike blocks.

Nothing else in the model knows the difference: `block` sees one block's parameters,
with the dense MLP's or with `experts`, as it does without interleaving.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

DENSE_MLP = ("w1", "w2", "w3", "b1", "b2", "b3")  # a dense block's own entries
EXPERTS = "experts"
DENSE = "dense"  # the first blocks' dense MLP (first_dense), apart from the rest
SILENT = ("wo", "bo", "w2", "b2")  # zeroed, they make a pre-norm block the identity
SILENT_EXPERTS = ("w2", "shared_w2")  # (the experts' output projections)


def depth(blocks: dict) -> int:
    """Blocks in the stack (every block has its first norm)."""
    return blocks["ln1"]["scale"].shape[0]


def interleave(blocks: dict) -> int:
    """n when every n-th block of the stack holds the experts and the others the dense
    MLP; 1 when every block is alike (all dense, or all with experts)."""
    if EXPERTS not in blocks or "w1" not in blocks:
        return 1
    return depth(blocks) // blocks[EXPERTS]["router"].shape[0]


def flat(entries: dict) -> dict:
    """A stack's (or one block's) entries with the dense first blocks' MLP in the place
    every other dense block keeps it: what one of those blocks reads."""
    return {**{k: v for k, v in entries.items() if k != DENSE}, **entries.get(DENSE, {})}


def _per_block(blocks: dict) -> tuple[int, dict]:
    """(the dense first blocks, the entries every block has) of a stack with DENSE."""
    return (blocks[DENSE]["w1"].shape[0],
            {key: v for key, v in blocks.items() if key not in (DENSE, EXPERTS)})


def runs(blocks: dict) -> list[dict]:
    """The stack as the runs of alike blocks it holds, in order: itself, or (first_dense)
    the first blocks with their dense MLP, then the rest with the experts."""
    if DENSE not in blocks:
        return [blocks]
    k, own = _per_block(blocks)
    head = {**jax.tree.map(lambda a: a[:k], own), **blocks[DENSE]}
    if EXPERTS not in blocks:  # a cut inside the dense blocks (`first`)
        return [head]
    return [head, {**jax.tree.map(lambda a: a[k:], own), EXPERTS: blocks[EXPERTS]}]


def scan(layer, x, blocks: dict, unroll=1):
    """lax.scan of `layer` ((x, one block's parameters) -> (x, statistics)) over the stack;
    by groups of n blocks when interleaved (the statistics: each group's expert block's);
    run after run when the first blocks are dense (the statistics: the last run's)."""
    if DENSE in blocks:
        for run in runs(blocks):
            x, stats = scan(layer, x, run, unroll)
        return x, stats
    n = interleave(blocks)
    if n == 1:
        return lax.scan(layer, x, blocks, unroll=unroll)

    def group(h, g):
        for i in range(n):  # n - 1 dense blocks, then the one with experts
            h, stats = layer(h, _block(g, i, n))
        return h, stats
    return lax.scan(group, x, _grouped(blocks, n), unroll=unroll)


def scan_blocks(layer, x, blocks: dict, xs, unroll=1):
    """lax.scan of `layer` ((h, one block's parameters, its own x) -> (h, y)) over the
    stack block by block, `xs` [depth, ...] giving each block its own: (h, ys [depth, ...]).
    Interleaved: by groups of n blocks, each block's y alike in structure. (A stack of
    alike blocks or of interleaved ones; the first blocks dense: `runs` first.)"""
    n = interleave(blocks)
    if n == 1:
        return lax.scan(lambda h, a: layer(h, *a), x, (blocks, xs), unroll=unroll)

    def group(h, a):
        g, mine = a
        ys = []
        for i in range(n):
            h, y = layer(h, _block(g, i, n), jax.tree.map(lambda t: t[i], mine))
            ys.append(y)
        return h, _stacked(ys)
    h, ys = lax.scan(group, x, (_grouped(blocks, n), _by_group(xs, n)), unroll=unroll)
    return h, _ungrouped(ys)


def map_blocks(fn, blocks: dict, xs):
    """jax.vmap of `fn` ((one block's parameters, its own x) -> y) over every block of the
    stack: ys [depth, ...]. Interleaved: over the groups, a group's n blocks written out."""
    n = interleave(blocks)
    if n == 1:
        return jax.vmap(fn)(blocks, xs)

    def group(g, mine):
        return _stacked([fn(_block(g, i, n), jax.tree.map(lambda t: t[i], mine))
                         for i in range(n)])
    return _ungrouped(jax.vmap(group)(_grouped(blocks, n), _by_group(xs, n)))


def _stacked(trees: list):
    return jax.tree.map(lambda *t: jnp.stack(t), *trees)


def _by_group(xs, n: int):  # [depth, ...] -> [depth / n, n, ...]
    return jax.tree.map(lambda t: t.reshape(t.shape[0] // n, n, *t.shape[1:]), xs)


def _ungrouped(ys):  # [groups, n, ...] -> [depth, ...]
    return jax.tree.map(lambda t: t.reshape(-1, *t.shape[2:]), ys)


def _grouped(blocks: dict, n: int) -> dict:
    def split(tree, size):
        return jax.tree.map(lambda a: a.reshape(a.shape[0] // size, size, *a.shape[1:]), tree)
    return {k: v if k == EXPERTS else split(v, n - 1 if k in DENSE_MLP else n)
            for k, v in blocks.items()}


def _block(group: dict, i: int, n: int) -> dict:
    """Block i of a group: its per-block entries, and the dense MLP's i-th entry or (the
    last block) the group's experts."""
    last, out = i == n - 1, {}
    for k, v in group.items():
        if k == EXPERTS or k in DENSE_MLP:
            if (k == EXPERTS) == last:
                out[k] = v if last else jax.tree.map(lambda a: a[i], v)
        else:
            out[k] = jax.tree.map(lambda a: a[i], v)
    return out


def first(blocks: dict, n_blocks: int) -> dict:
    """The stack of the first `n_blocks` blocks (interleaved: whole groups of them), the
    parameters of ModelConfig.first_blocks(n_blocks)."""
    if DENSE in blocks:  # (a cut inside the dense blocks: a plain dense stack)
        k, own = _per_block(blocks)
        cut = jax.tree.map(lambda a: a[:n_blocks], own)
        if n_blocks <= k:
            return {**cut, **jax.tree.map(lambda a: a[:n_blocks], blocks[DENSE])}
        return {**cut, DENSE: blocks[DENSE],
                EXPERTS: jax.tree.map(lambda a: a[:n_blocks - k], blocks[EXPERTS])}
    n = interleave(blocks)
    if n_blocks % n:
        raise ValueError(f"a cut of {n_blocks} blocks splits a group of {n} (moe_every)")
    keep = {} if n == 1 else {EXPERTS: n_blocks // n,
                              **dict.fromkeys(DENSE_MLP, n_blocks - n_blocks // n)}
    return {k: jax.tree.map(lambda a, m=keep.get(k, n_blocks): a[:m], v)
            for k, v in blocks.items()}


def silent(blocks: dict, zeros) -> dict:
    """The stack with every block the identity: each sub-layer's output projection (and
    its bias) replaced by zeros_like(it), the experts' included."""
    out = {**blocks, **{k: zeros(blocks[k]) for k in SILENT if k in blocks}}
    if DENSE in blocks:
        out[DENSE] = {**blocks[DENSE], **{k: zeros(blocks[DENSE][k]) for k in SILENT
                                          if k in blocks[DENSE]}}
    if EXPERTS in blocks:
        out[EXPERTS] = {**blocks[EXPERTS], **{k: zeros(v) for k, v in blocks[EXPERTS].items()
                                              if k in SILENT_EXPERTS}}
    return out
