"""A pipeline stage's backward in two actions: B (the input gradient) and W (the weights').

The zero-bubble schedules (jaxscale.parallel.zero_bubble) need them apart: the previous
stage waits for B only, W can wait for a gap. The stage is embed (first stage only), L
blocks, head and loss (last stage only); h_0 is the blocks' input and h_l the output of
block l-1.

B   recomputes the stage's forward from its stored input x, as the joint backward does,
    and runs autodiff back through the activations only: the weights are constants of
    this function, so no weight gradient is computed. To get the gradient at every layer
    boundary, g_l = dLoss/dh_l, from one backward pass, a zero "probe" e_l is added to
    each h_l and B differentiates with respect to the probes: dLoss/de_l = g_l. It keeps
    the L+1 boundary activations h_l and their gradients g_l for W, and sends g_0 back.
W   for each layer at once (vmap over the layer axis) recomputes the block's forward from
    h_l and pulls g_{l+1} back to the block's weights; the embedding's gradient from g_0
    (first stage), the head's from h_L and the loss's cotangent (last stage).

A mixture of experts' block also returns its router's objective (its share of the loss,
already weighted: 1/m per micro-batch; 0 for the dense blocks between interleaved
experts, which B and W visit group by group: model.stack.scan_blocks and map_blocks). B adds every layer's to the loss it
differentiates, so each g_l carries the routers' gradient too; W pulls each layer's
objective back with the loss's cotangent, beside g_{l+1}.

Cost, next to the joint backward (one forward recompute, then the activations' and the
weights' gradients): one more forward, W's per-layer recompute. Memory: from B until W a
micro-batch holds 2(L+1) activations of the stage's width, against one (its input) from F
until B. Both are the price of keeping only layer boundaries, not every intermediate.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxscale.model import fp8_history, stack
from jaxscale.runtime.vma import cotangent, vary, varying_axes


class StageParts(NamedTuple):
    """The pieces of a stage, each a pure function of the parameters it is given."""

    embed: Callable  # (params, tokens) -> h_0 on the first stage
    block: Callable  # (one layer's params, h) -> (h, its router's objective or None)
    head_loss: Callable  # (params, h_L, micro-batch) -> this micro-batch's share of the loss
    chunk_blocks: Callable  # (params["blocks"], chunk) -> this chunk's layers
    remat_policy: object  # a jax.checkpoint policy for each layer's forward, or None
    unroll: bool


def input_gradient(parts: StageParts, prm, x, mb, first, last, chunk, dy, ct):
    """B: (dx for the previous stage, h [L+1, ...], g [L+1, ...]); see the module docstring.
    `dy`: the gradient at the stage's output (unused on the last stage); `ct`: the loss's
    cotangent (used only on the last stage)."""
    blocks = parts.chunk_blocks(prm["blocks"], chunk)
    n = stack.depth(blocks)

    def layer(h, p_l, probe):
        y, objective = parts.block(p_l, h)
        return y + probe, (h, objective)

    if parts.remat_policy is not None:
        layer = jax.checkpoint(layer, policy=parts.remat_policy)

    def probed(probes):
        h0 = jnp.where(first, parts.embed(prm, mb["tokens"]).astype(x.dtype), x) + probes[0]
        h_last, (inputs, objectives) = stack.scan_blocks(layer, h0, blocks, probes[1:],
                                                         unroll=True if parts.unroll else 1)
        loss = jnp.where(last, parts.head_loss(prm, h_last, mb), 0.0)
        if objectives is not None:  # the routers' (every stage's own)
            loss = loss + jnp.sum(objectives)
        return (h_last, loss), jnp.concatenate([inputs, h_last[None]])

    # the probes vary like x: each device differentiates its own copy (no implicit psum)
    probes = vary(jnp.zeros((n + 1, *x.shape), x.dtype), tuple(sorted(varying_axes(x))))
    (h_last, loss), pullback, hs = jax.vjp(probed, probes, has_aux=True)
    dy = jnp.where(last, jnp.zeros_like(dy), dy)
    (gs,) = pullback((dy, cotangent(ct, loss)))
    return jnp.where(first, jnp.zeros_like(gs[0]), gs[0]), hs, gs


def weight_gradient(parts: StageParts, prm, hs, gs, mb, first, last, chunk, ct,
                    history=None):
    """W: the gradients of all of `prm` (zero outside this chunk and stage's own pieces)
    from B's boundary activations `hs` and their gradients `gs`. With fp8-delayed's
    `history`: (those gradients, the amaxes its products report: model.fp8_history)."""
    block = parts.block if parts.remat_policy is None else jax.checkpoint(
        parts.block, policy=parts.remat_policy)  # what each layer keeps, as in the forward

    def outputs(p, seen=None):
        p = fp8_history.attach(p, seen)
        blocks = parts.chunk_blocks(p["blocks"], chunk)
        per_layer = stack.map_blocks(block, blocks, hs[:-1])  # every layer at once
        h0 = jnp.where(first, parts.embed(p, mb["tokens"]).astype(hs.dtype),
                       jnp.zeros_like(hs[0]))
        return per_layer, h0, jnp.where(last, parts.head_loss(p, hs[-1], mb), 0.0)

    def cts(per_layer, loss):  # the routers' objectives take the loss's cotangent
        ys, objectives = per_layer
        own = None if objectives is None else cotangent(
            jnp.broadcast_to(ct, objectives.shape), objectives)
        return ((gs[1:], own), jnp.where(first, gs[0], jnp.zeros_like(gs[0])),
                cotangent(ct, loss))
    if history is None:
        (per_layer, h0, loss), pullback = jax.vjp(outputs, prm)
        (d_prm,) = pullback(cts(per_layer, loss))
        return d_prm
    (per_layer, h0, loss), pullback = jax.vjp(outputs, prm, history)
    d_prm, reported = pullback(cts(per_layer, loss))
    return d_prm, fp8_history.newest(reported)
