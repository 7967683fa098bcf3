"""A mixture of experts in the MLP's place: a router picks each token's top-k of E MLPs.

Read top to bottom, one layer does this (GShard's recipe, Lepikhin et al. 2020, with
Switch's and ST-MoE's router losses):

    route      logits = x W_router (fp32), probs = softmax(logits); each token keeps its
               top_k experts, their probabilities renormalised to sum to 1 (Mixtral's
               gates); top-1 keeps its raw probability (Switch's: renormalised it would be
               1, and the loss would give the router no gradient)
    assign     each (token, choice) takes the next place in its expert's queue, every
               token's first choice before any second choice; an expert holds C places
               and an assignment beyond them is dropped (the token goes on through the
               residual alone). C = ceil(capacity_factor x top_k x N / E) for the N
               tokens of one device's micro-batch, or N when dropless (no expert can be
               asked twice by one token: E x the dense MLP's work, the price of fixed
               shapes; a grouped matmul over the sorted tokens would not pay it)
    dispatch   expert_in[E, C, d] = the tokens in their places (a scatter; combine reads
               them back with a gather: memory N k d, not the N E C of a one-hot einsum)
    exchange   with expert parallelism (`ep_axis`): an all-to-all sends each device's
               places for expert e to the device that holds e, [E, C, d] -> [E/ep, ep C, d];
               each device runs its E/ep experts on the tokens of all ep devices
    experts    each expert is the model's MLP (GELU or SwiGLU), no biases (as Mixtral's
               and DeepSeek's); the shared experts (`n_shared_experts`) are one MLP of
               their total width that every token passes through
    return     the all-to-all back, [E/ep, ep C, d] -> [E, C, d]; y = sum over the token's
               places of gate x expert output, plus the shared experts' output

Bytes: each all-to-all moves E C d elements per device (of which (ep-1)/ep leave it);
dispatch and combine run forward and, transposed, backward: four per layer per
micro-batch (six in a pipeline, whose B ticks run the stage's forward again).

The router learns under two losses, returned as statistics with the layer's output:
    aux = E sum_i f_i P_i   Switch's load balance: f_i the share of assignments that chose
                            expert i (before capacity), P_i its mean router probability;
                            1 when balanced, E when every token picks one expert
    z   = mean (logsumexp logits)^2   ST-MoE's z-loss: keeps the router's logits small
Both are over the micro-batch's tokens on every device (`token_axes`), so a split batch
gives the single device's figure: f_i is summed over devices, and each device adds its own
tokens' share of P_i and z (a contribution; the contributions psum to the whole). The
devices that hold the same tokens (tp) count them once: where the loss is the same on
each of them (`copy_axes`: tp) the contribution is too (each adds 1/tp, then a psum over
tp); where the loss is a sum over them (`shared_axes`: tp under sequence parallelism)
each keeps its 1/tp, as its share of the sum.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jaxscale.model import fp8
from jaxscale.model.config import Family, ModelConfig
from jaxscale.runtime.vma import COLLECTIVE, vary

# the statistics a layer returns: contributions (psum over the token axes gives the
# micro-batch's value) and figures already global
CONTRIBUTIONS = ("objective", "aux", "z")
GLOBAL = ("dropped", "load_max")


class Experts(nnx.Module):
    """The MoE layers' parameters (leading `layers` axis: one entry per block that holds
    experts, cfg.moe_layers): the router [d, E], the routed experts' MLPs [E, d, f] and
    [E, f, d] (SwiGLU: and its value matrix), and the shared experts as one MLP of width
    n_shared x f."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        L, d, e, f = cfg.moe_layers, cfg.d_model, cfg.n_experts, cfg.expert_d_ff
        std, residual = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)

        def param(shape, axes, scale=std):
            return nnx.Param(scale * jax.random.normal(rngs.params(), shape), axes=axes)
        self.router = param((L, d, e), ("layers", "embed", "router"))  # whole everywhere
        self.w1 = param((L, e, d, f), ("layers", "experts", "embed", "mlp"))
        self.w2 = param((L, e, f, d), ("layers", "experts", "mlp", "embed"), residual)
        if cfg.mlp == "swiglu":
            self.w3 = param((L, e, d, f), ("layers", "experts", "embed", "mlp"))
        if cfg.n_shared_experts:
            fs = cfg.n_shared_experts * f
            self.shared_w1 = param((L, d, fs), ("layers", "embed", "mlp"))
            self.shared_w2 = param((L, fs, d), ("layers", "mlp", "embed"), residual)
            if cfg.mlp == "swiglu":
                self.shared_w3 = param((L, d, fs), ("layers", "embed", "mlp"))


def capacity(n_tokens: int, n_experts: int, family: Family) -> int:
    """Places per expert for one device's `n_tokens` (dropless: all of them)."""
    if family.capacity_factor is None:
        return n_tokens
    return min(n_tokens, math.ceil(family.capacity_factor * family.top_k * n_tokens
                                   / n_experts))


def route(router, tokens, top_k: int):
    """(logits [N, E] fp32, probs [N, E], gates [N, k], experts [N, k]): each token's
    top_k experts and their probabilities, renormalised when k > 1."""
    logits = tokens.astype(jnp.float32) @ router.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    gates, experts = lax.top_k(probs, top_k)
    return logits, probs, gates / gates.sum(-1, keepdims=True) if top_k > 1 else gates, experts


def assign(experts, n_experts: int, places: int):
    """(place [N, k] in the experts' places flattened to E x C, or E x C where dropped;
    kept [N, k]): each (token, choice) takes the next place in its expert's queue, every
    token's first choice before any second choice."""
    n, k = experts.shape
    choice = jax.nn.one_hot(experts, n_experts, dtype=jnp.int32)  # [N, k, E]
    queue = choice.transpose(1, 0, 2).reshape(k * n, n_experts)  # choice-major order
    ahead = ((jnp.cumsum(queue, axis=0) - queue) * queue).sum(-1).reshape(k, n).T  # [N, k]
    kept = ahead < places
    return jnp.where(kept, experts * places + ahead, n_experts * places), kept


def dispatch(tokens, place, n_experts: int, places: int):
    """expert_in [E, C, d]: each kept (token, choice) written to its place, the rest 0."""
    n, k = place.shape
    spread = jnp.broadcast_to(tokens[:, None, :], (n, k, tokens.shape[-1]))
    flat = jnp.zeros((n_experts * places, tokens.shape[-1]), tokens.dtype)
    # an add (the kept places are distinct, the buffer zeros): the same values as a set,
    # whose gradient through repeated indices (the dropped ones) JAX computes the slow way
    return flat.at[place].add(spread, mode="drop").reshape(n_experts, places, -1)


def combine(outputs, place, gates):
    """[N, d]: each token's gate-weighted outputs read back from its places (a dropped
    choice reads 0)."""
    flat = outputs.reshape(-1, outputs.shape[-1])
    read = flat.at[place].get(mode="fill", fill_value=0)  # [N, k, d]
    return jnp.einsum("nk,nkd->nd", gates.astype(outputs.dtype), read)


def mlp(x, w1, w2, w3, family: Family, lead: str = ""):
    """The MLP on x [.., C, d] with weights [lead.., d, f]; `lead` "e": one per expert.
    Its products under the family's recipe; in FP8 each expert scales its own tensors
    (current scaling: its tokens' amax and its weights'; fp8-block: its own tiles)."""
    if lead and family.matmul != "native":  # one expert at a time, each its own scales
        return jax.vmap(lambda *a: mlp(*a, family))(x, w1, w2, w3)
    dot = fp8.matmul(family.matmul, family.fp8_block)
    up = dot(f"{lead}cd,{lead}df->{lead}cf", x, w1)
    if family.mlp == "swiglu":
        hidden = jax.nn.silu(up) * dot(f"{lead}cd,{lead}df->{lead}cf", x, w3)
    else:
        hidden = jax.nn.gelu(up)
    return dot(f"{lead}cf,{lead}fd->{lead}cd", hidden, w2)


def layer(p, x, reduce, family: Family):
    """The layer on x [B, T, d] (the normed residual): (output [B, T, d], statistics).
    `reduce` joins tensor-parallel partial outputs (jaxscale.model.block.tp_operators):
    with tp each device holds a share of every expert's hidden units."""
    b, t, d = x.shape
    tokens = x.reshape(b * t, d)
    n_experts = p["router"].shape[-1]
    logits, probs, gates, experts = route(p["router"], tokens, family.top_k)
    places = capacity(b * t, n_experts, family)
    place, kept = assign(experts, n_experts, places)
    inputs = dispatch(tokens, place, n_experts, places)
    if family.ep_axis:  # to the devices that hold the experts (named: a remat policy
        inputs = checkpoint_name(  # may keep what it would otherwise send again)
            lax.all_to_all(inputs, family.ep_axis, 0, 1, tiled=True), COLLECTIVE)
    outputs = mlp(inputs, p["w1"], p["w2"], p.get("w3"), family, lead="e")
    if family.ep_axis:  # and back
        outputs = checkpoint_name(lax.all_to_all(outputs, family.ep_axis, 1, 0, tiled=True),
                                  COLLECTIVE)
    y = combine(outputs, place, gates)
    if "shared_w1" in p:
        y = y + mlp(tokens, p["shared_w1"], p["shared_w2"], p.get("shared_w3"), family)
    return reduce(y.reshape(b, t, d)), statistics(logits, probs, experts, kept, family)


def statistics(logits, probs, experts, kept, family: Family) -> dict:
    """The router's losses (this device's contributions) and its global load figures."""
    n, k = experts.shape
    n_experts = probs.shape[-1]
    same = family.copy_axes + family.shared_axes  # the axes whose devices hold my tokens
    axes = family.token_axes + same
    copies = math.prod(lax.axis_size(a) for a in same)
    everywhere = n * math.prod(lax.axis_size(a) for a in family.token_axes)

    def psum(v, over):
        return lax.psum(vary(v, over), over) if over else v

    def total(v):  # over every device's tokens, each copy counted once
        return psum(v, axes) / copies

    def mine(v):  # this device's contribution: its tokens' share, its copy's share of it
        return psum(v / everywhere / copies, family.copy_axes)
    # assignments per expert (named: a remat policy keeps it rather than sum it again)
    load = checkpoint_name(total(jax.nn.one_hot(experts, n_experts).sum((0, 1))), COLLECTIVE)
    share = lax.stop_gradient(load / (k * everywhere))  # f_i
    aux = mine(n_experts * jnp.sum(share * probs.sum(0)))
    z = mine(jnp.sum(jnp.square(jax.nn.logsumexp(logits, axis=-1))))
    w_aux, w_z = family.router_weights
    return {"objective": w_aux * aux + w_z * z, "aux": aux, "z": z,
            "dropped": total(jnp.sum(~kept).astype(jnp.float32)) / (k * everywhere),
            "load_max": jnp.max(load) / jnp.mean(load)}


def over_layers(stats: dict) -> dict:
    """A forward pass's statistics from its layers' ([L] each): the objective summed (each
    layer's router learns under its own loss), the rest averaged, the worst load kept."""
    if not stats:
        return {}
    out = {k: jnp.mean(v) for k, v in stats.items()}
    return {**out, "objective": jnp.sum(stats["objective"]),
            "load_max": jnp.max(stats["load_max"])}


def per_micro(stats: dict, micro, m: int) -> dict:
    """A forward pass's figures in a pipeline's tally (jaxscale.parallel.pipeline), which
    keeps each of the `m` micro-batches' worst load apart: plain DP averages the
    micro-batches' worst loads, and a pipeline must too ({} for a dense model)."""
    if not stats:
        return stats
    return {**stats, "load_max": jnp.zeros(m, jnp.float32).at[micro].set(stats["load_max"])}


def add_statistics(a: dict, b: dict) -> dict:
    """Two tallies (per_micro's) together: summed, the worst load kept."""
    return {k: jnp.maximum(a[k], b[k]) if k == "load_max" else a[k] + b[k] for k in a}


def over_stages(stats: dict, axis: str, chunks: int, m: int) -> dict:
    """A pipeline's figures: each device's tally over its forward ticks, joined over the
    stages' `axis` into the mean over the `m` micro-batches of the mean over the model's
    `chunks` (each chunk's figures a mean over its layers, every chunk as many), and of
    the worst load of any chunk: what plain DP reports for the same micro-batches."""
    out = {k: lax.psum(v, axis) / (chunks * m) for k, v in stats.items()}
    return {**out, "load_max": jnp.mean(lax.pmax(stats["load_max"], axis))}


def metrics(stats: dict, axes=()) -> dict:
    """The figures a step reports: the contributions summed over the mesh `axes` the loss
    is summed over (the batch's), each named moe_<figure>; the objective left out."""
    def whole(name, v):
        return lax.psum(vary(v, axes), axes) if axes and name in CONTRIBUTIONS else v
    return {f"moe_{k}": whole(k, v) for k, v in stats.items() if k != "objective"}
