"""ZeRO: the data-parallel step without the redundant copies, as real sharding on `dp`.

Every parameter tensor is flattened and padded with zeros to a multiple of K (the dp size)
and cut into K equal slices; device i owns slice i. A block parameter (leading `layers`
axis, L layers) is flattened per layer, to [L, K*c], so each device owns [L, c]: one
layer's slices can be gathered on their own. Padding is exact: padded entries get zero
gradients and zero Adam moments, so they stay zero. Padding, not refusal, is the answer
to a tensor whose size K does not divide (the tiny model's 3,232-element embedding at K=3).

  stage 1  the optimizer state (and fp32 master weights) exist only as owned slices:
           reduce-scatter the gradients, update the owned slice, all-gather the parameters
  stage 2  the gradients, too, are kept only as owned slices: each micro-batch's gradients
           are reduce-scattered at once and accumulated as slices (with one micro-batch
           stages 1 and 2 are the same program)
  stage 3  the parameters, too, exist only as slices. The forward pass all-gathers each
           unit's parameters (embeddings, one block, the head) just before it runs, under
           `jax.checkpoint`, so the gathered copy is dropped and gathered again in the
           backward pass. Differentiating all_gather gives psum_scatter: each parameter's
           gradient arrives already reduce-scattered (see jaxscale.model.transformer.forward)

Communication per step: stages 1 and 2 equal plain data parallelism (an all-reduce is a
reduce-scatter followed by an all-gather; ZeRO moves the update between the two). Stage 3
gathers every parameter twice and reduce-scatters its gradient once: 3 x (K-1)/K x Psi
against DP's 2 x (K-1)/K x Psi, i.e. 1.5 x in the textbook. Ours differs, tensor by
tensor (`stage3_ring_bytes`): a parameter whose backward pass does not need it is not
gathered again (an embedding lookup's backward is a scatter-add), and the tied embedding
is gathered by two units, the lookup and the head: 1.57 x DP for the tiny model.

The optimizer must be elementwise (every state leaf a scalar or shaped like its
parameter): SGD, momentum, AdaGrad, RMSProp, Adam(W) are; a factored or norm-based one
would see only a slice and is refused.
"""
from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxscale.model import fp8_history, moe, precision, stack, transformer as modellib
from jaxscale.model.config import GPT2, Family
from jaxscale.model.loss import logits_nll_and_count, nll_and_count
from jaxscale.parallel.canonical import Canonical
from jaxscale.parallel import step as steplib
from jaxscale.parallel.step import PlanStep, shard_step
from jaxscale.parallel.data_parallel import accumulated_value_and_grad
from jaxscale.parallel.zero_layout import ZeroLayout, is_stacked, padded_size, zero_layout
from jaxscale.runtime import mesh as meshlib


class ZeroError(ValueError):
    """An optimizer or plan that ZeRO cannot shard."""


def forward_gathered(slices, tokens, remat: str, fetch, attention: str = "einsum",
                     unroll: bool = False, tp_axis: str | None = None, seq=None,
                     family: Family = GPT2):
    """ZeRO-3's forward: model.forward's units on parameter slices (`gathered_units`);
    (logits, the routers' statistics: model.moe.over_layers, {} for a dense model)."""
    embed, layers, head = gathered_units(fetch, remat, attention, unroll, tp_axis, seq, family)
    x, stats = layers(slices["blocks"], embed(slices, tokens), stats=True)
    return head(slices, x), stats


def layer_policy(remat: str):
    """What a ZeRO-3 layer keeps for backward: the remat policy's choice, or with none the
    matmul outputs and tp's collective outputs (not sent twice), never a gathered weight."""
    saveable = jax.checkpoint_policies
    keep = saveable.save_from_both_policies(
        saveable.dots_saveable, saveable.save_only_these_names(modellib.COLLECTIVE))
    return modellib.REMAT_POLICIES[remat] or keep


def gathered_units(fetch, remat: str, attention: str = "einsum", unroll: bool = False,
                   tp_axis: str | None = None, seq=None, family: Family = GPT2):
    """(embed(slices, tokens), layers(block_slices, x), head(slices, x)): model.forward's
    units on parameter slices, each unit gathering its whole tensors with
    `fetch(unit_slices, layer)` just before it runs (on a tp mesh: its whole tp shards, and
    the blocks run tensor parallel over `tp_axis`; `seq` as in model.forward). The whole
    model runs them in turn; a pipeline stage runs its own chunk's layers and masks the
    embedding and head where it does not own them.

    Every unit runs under `jax.checkpoint` with a policy that keeps activations (matmul
    outputs, or what the remat policy keeps) but never a gathered parameter, so the gathered
    copy is dropped after the forward pass and gathered again in the backward pass when the
    backward needs it.

    A unit's gathers do not depend on its activations, so XLA may start them early, and
    XLA's CPU runtime gives every collective of one kind the same rendezvous key (JAX
    lowers them all with channel id 1): two all-gathers in flight at once on one device,
    the head's and a layer's inside the loop, meet in one rendezvous and abort the process
    ("Check failed: id < num_threads"). An optimization barrier does not order them (XLA's
    CPU pipeline removes it), a data dependency does: `after(p, x)` is p + 0 * (one
    element of x), exact for finite x. The unit's gathers then wait for its input, and in
    backward its reduce-scatters finish before the input's gradient flows on.
    """
    def after(p, x):
        zero = 0 * jnp.ravel(x)[0]
        return jax.tree.map(lambda t: t + zero.astype(t.dtype), p)

    def embed_unit(p, tokens):  # the first unit: nothing runs before it
        return modellib.embed(fetch(p, False), tokens, seq, family)

    def layer(x, p):  # (fp8-delayed's histories are no slices: they pass by the gather)
        p, seen = _apart(p, fp8_history.BLOCKS)
        return modellib.block_with_stats({**fetch(after(p, x), True), **seen}, x, tp_axis,
                                         attention, seq, family)

    def head_unit(p, x):
        p, seen = _apart(p, fp8_history.HEAD)
        return modellib.head({**fetch(after(p, x), False), **seen}, x, family)

    saveable = jax.checkpoint_policies
    embed_unit = jax.checkpoint(embed_unit, policy=saveable.nothing_saveable)
    head_unit = jax.checkpoint(head_unit, policy=saveable.dots_saveable)
    layer = jax.checkpoint(layer, policy=layer_policy(remat))

    def embed(slices, tokens):  # the token table, and the position table if there is one
        return embed_unit({k: slices[k] for k in EMBED_UNIT if k in slices}, tokens)

    def layers(blocks, x, stats: bool = False):  # (and the routers' statistics)
        x, s = stack.scan(layer, x, blocks, unroll=True if unroll else 1)
        return (x, moe.over_layers(s)) if stats else x

    def head(slices, x):  # the final norm and the output head: its own, or the token table
        own = "unembed" if "unembed" in slices else "tok_embed"
        unit = {k: slices[k] for k in ("ln_f", own, fp8_history.HEAD) if k in slices}
        return head_unit(unit, x)
    return embed, layers, head


def _apart(p: dict, key: str) -> tuple[dict, dict]:
    """(p without `key`, {key: p[key]} or {}): a unit's slices apart from what is no slice."""
    return {k: v for k, v in p.items() if k != key}, ({key: p[key]} if key in p else {})


EMBED_UNIT = ("tok_embed", "pos_embed")


def zero_value_and_grad(graphdef, layout: ZeroLayout, micro_batches: int, remat: str = "none",
                        attention: str = "einsum", unroll: bool = False,
                        family: Family = GPT2):
    """grad_fn for steplib.make_step: (global loss, this device's slice of the gradients),
    reduced as the layout's stage says (`layout.reduction()`). Stage 3 differentiates the
    slices themselves, each unit's parameters gathered where it runs."""
    if layout.stage == 3:
        def nll(slices, mb, history=None):
            logits, stats = forward_gathered(fp8_history.attach(slices, history), mb["tokens"],
                                             remat, layout.fetch, attention, unroll,
                                             family=family)
            out = logits_nll_and_count(logits, mb)
            return (*out, stats) if stats else out
    else:
        nll = partial(nll_and_count, graphdef)
    return accumulated_value_and_grad(nll, micro_batches, layout.reduction())


def check_elementwise(opt_state, target, who: str = "ZeRO") -> None:
    """Refuse an optimizer whose state is not elementwise: `who` updates each device's own
    slice or shard of the parameters, where a factored or norm-based state would be wrong."""
    sizes = {x.shape for x in jax.tree.leaves(target)}
    for leaf in jax.tree.leaves(opt_state):
        if leaf.ndim and leaf.shape not in sizes:
            raise ZeroError(f"the optimizer keeps a state tensor of shape {leaf.shape} that is not "
                            f"shaped like a parameter; {who} updates each device's own slice, so "
                            "it takes only elementwise optimizers (sgd, momentum, adagrad, "
                            "rmsprop, adam, adamw)")


def build_zero(graphdef, plan, optimizer, pol: precision.Policy, param_shapes, devices=None,
               family: Family = GPT2):
    """(init, step) for plan.zero_stage in (1, 2, 3) on a dp mesh (`family`: the model's,
    for stage 3's own forward)."""
    devices = list(jax.devices() if devices is None else devices)[:plan.n_devices]
    mesh = meshlib.make_mesh(plan.mesh_shape, devices)
    layout = zero_layout(param_shapes, plan.dp, plan.zero_stage)
    update = steplib.make_step(
        graphdef, optimizer, pol, jit=False, layout=layout,
        grad_fn=zero_value_and_grad(graphdef, layout, plan.micro_batches, plan.remat,
                                    plan.attention, plan.unroll, family))

    def fresh_state(params32):
        return steplib.init_state(params32, optimizer, pol, arrange=layout.flatten,
                                    arrange_params=plan.zero_stage == 3)

    abstract = jax.eval_shape(fresh_state, param_shapes)
    check_elementwise(abstract.opt_state, jax.eval_shape(layout.flatten, param_shapes))
    state_specs = jax.tree.map(layout.spec, abstract)
    state_specs = state_specs._replace(fp8=jax.tree.map(lambda _: P(), abstract.fp8))
    if plan.zero_stage < 3:  # the working parameters stay whole on every device
        state_specs = state_specs._replace(params=jax.tree.map(lambda _: P(), abstract.params))
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), state_specs)

    def init(params32):
        return jax.device_put(fresh_state(params32), shardings)

    compiled, guarded = shard_step(update, mesh, state_specs)
    return init, PlanStep(mesh, compiled,
                             jax.jit(lambda state: layout.full_params(state.params)),
                             Canonical(layout, optimizer, pol, param_shapes, mesh, shardings),
                             guarded)


# Stage 3's traffic, tensor by tensor. A gather runs where a unit uses a tensor: in the
# forward pass once per unit that uses it, and in the backward pass once per unit whose
# backward needs its value; every forward gather's transpose is one reduce-scatter.
# The textbook 1.5 x DP assumes 2 gathers and 1 reduce-scatter for every tensor; ours differ:
FORWARD_UNITS = {"tok_embed": 2}  # the tied table: the embedding lookup and the output head
BACKWARD_UNITS = {
    "tok_embed": 1,  # the head's backward needs E; the lookup's backward is a scatter-add
    "pos_embed": 0,  # an added embedding: its backward needs no weights
    "b2": 0,  # the block's last bias feeds only the saved block output: nothing recomputes it
}
# An untied head (Llama): the token table is used once (the lookup, whose backward needs no
# weights) and the head's own table U once forward and once backward.
UNTIED_UNITS = {"tok_embed": (1, 0)}


# With sequence parallelism a block's LayerNorm outputs are not recomputed in backward: the
# sequence all-gather after each is kept (its output is named model.COLLECTIVE), so the
# LayerNorms' biases, which only shift those outputs, are not gathered again.
SEQUENCE_PARALLEL_BACKWARD_UNITS = {"ln1.bias": 0, "ln2.bias": 0}


def stage3_ring_bytes(shapes, k: int, itemsize: int,
                      sequence_parallel: bool = False) -> dict[str, float]:
    """Predicted bytes one device sends per step under ZeRO-3 (ring collectives, one
    micro-batch), next to the textbook's 3 x (K-1)/K x Psi and DP's 2 x (K-1)/K x Psi."""
    ring = (k - 1) / k
    out = {"all_gather": 0.0, "reduce_scatter": 0.0, "textbook": 0.0, "dp": 0.0}
    backward = {**BACKWARD_UNITS, **(SEQUENCE_PARALLEL_BACKWARD_UNITS if sequence_parallel
                                     else {})}
    untied = "unembed" in shapes
    for path, s in jax.tree_util.tree_leaves_with_path(shapes):
        keys = [p.key for p in path]
        name = ".".join(keys[-2:]) if keys[-1] in ("scale", "bias") else keys[-1]
        layers = s.shape[0] if is_stacked(path) else 1
        n = math.prod(s.shape) // layers
        padded = ring * padded_size(n, k) * itemsize * layers
        fwd, bwd = FORWARD_UNITS.get(name, 1), backward.get(name, 1)
        if untied and name in UNTIED_UNITS:
            fwd, bwd = UNTIED_UNITS[name]
        out["all_gather"] += (fwd + bwd) * padded
        out["reduce_scatter"] += fwd * padded
        out["textbook"] += 3 * padded
        out["dp"] += 2 * ring * n * layers * itemsize
    out["total"] = out["all_gather"] + out["reduce_scatter"]
    return out
