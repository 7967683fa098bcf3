"""What backward keeps of one block: the saved activations per layer, from the traced program.

Between a layer's forward and its backward, autodiff keeps some of the forward's values
(the residuals): which ones is the remat policy's choice (jaxscale.model.transformer's
REMAT_POLICIES). jax reports them for any function (`saved_residuals`, the function behind
the public `jax.ad_checkpoint.print_saved_residuals`): each value's shape and dtype and
the operation and source line that made it. Here the function is one block as one device
of a layout runs it:

  rows       batch / (dp x micro_batches): one micro-batch of this device's rows
  tokens     seq / cp: this device's share of the sequence
  weights    one layer's parameters, split over tp where the layout splits them (heads,
             MLP units), in the precision policy's compute dtype

Left out, and said so: the collectives (tp's all-reduces, the cp ring) are not traced, so a
policy's choice to keep their outputs does not show and cp's ring keeps more than this
(each hop's blocks and the K and V it received); sequence parallelism's split of the
norms and residual adds (T/tp between the sub-layers) does not show; and the embedding,
the head and the loss (logits: rows x T x vocab) are not blocks. The layer's weights are
not activations: the rows list the block's input and the values made inside it. ZeRO-3
runs its layers under its own policy (matmul outputs kept, never a gathered weight).

What a device holds at once (`_held`): without a pipeline, every layer's residuals of one
micro-batch; a pipeline keeps its schedule's slots of stage inputs (and gradients) and
recomputes a chunk's forward in its backward, so it adds one chunk's residuals.
"""
from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals  # behind print_saved_residuals

from jaxscale.model import precision, stack, transformer as modellib
from jaxscale.model.block import block
from jaxscale.parallel.axes import TP
from jaxscale.parallel import zero
from jaxscale.parallel.hybrid import param_specs
from jaxscale.parallel.tick_table import tick_table


def block_residuals(cfg, plan, batch_size: int) -> dict:
    """The residuals of one block on one device of `plan` (module docstring): one row per
    saved value (shape, dtype, bytes, what made it), their sum per layer, and the total a
    device holds at its peak."""
    rows_here = batch_size // (plan.rows * plan.micro_batches)
    tokens = cfg.seq_len // plan.cp
    dtype = precision.policy(plan.precision).compute_dtype
    # a mixture of experts' layer as on one device, without its all-to-all: ep's E / ep
    # experts over ep x C places hold what E experts over C places do
    weights = _layer_weights(cfg, dataclasses.replace(plan, ep=1), dtype)
    x = jax.ShapeDtypeStruct((rows_here, tokens, cfg.d_model), dtype)
    family = dataclasses.replace(plan.family(cfg), token_axes=(), copy_axes=(),
                                 shared_axes=(), ep_axis=None)

    def one_block(p, x):
        return block(p, x, None, plan.attention, None, family)
    policy = (zero.layer_policy(plan.remat) if plan.zero_stage == 3  # ZeRO-3's own choice
              else modellib.REMAT_POLICIES[plan.remat])
    if policy is not None:
        one_block = jax.checkpoint(one_block, policy=policy)
    rows, each = [], {}  # each kind of block: (its bytes, how many)
    for kind, (w, n) in _kinds(cfg, weights).items():
        mine = [_row(aval, source, kind) for aval, source in saved_residuals(one_block, w, x)
                if not source.startswith(("from the argument p", "from a literal"))]
        rows, each[kind] = rows + mine, (sum(r["bytes"] for r in mine), n)
    per_layer = sum(b * n for b, n in each.values()) / cfg.n_layers  # (interleaved: the mean)
    held = _held(cfg, plan, int(per_layer), rows_here * tokens * cfg.d_model * dtype.itemsize)
    if len(each) > 1:  # (no pipeline: a mixture of experts has none)
        held = {"total": sum(b * n for b, n in each.values()),
                "how": " + ".join(f"{b:,} B {kind} x {n}" for kind, (b, n) in each.items())}
    left_out = ["the embedding, the head and the loss"] + [
        what for what, there in (("tp's collective outputs", plan.tp > 1),
                                 ("sequence parallelism's split", plan.sequence_parallel),
                                 ("the cp ring's hops", plan.cp > 1)) if there]
    return {"rows_per_micro_batch": rows_here, "tokens": tokens, "remat": plan.remat,
            "left_out": left_out,
            "rows": sorted(rows, key=lambda r: -r["bytes"]),
            "per_layer": int(per_layer) if per_layer == int(per_layer) else per_layer, **held}


def _kinds(cfg, weights: dict) -> dict:
    """The kinds of block in the stack, each with its weights and how many there are:
    one, or with interleaved experts (moe_every > 1) or dense first blocks (first_dense)
    the dense blocks and the expert blocks (jaxscale.model.stack)."""
    if cfg.moe_layers in (0, cfg.n_layers):
        return {"": (weights, cfg.n_layers)}
    dense = stack.flat({k: v for k, v in weights.items() if k != stack.EXPERTS})
    return {"a dense block": (dense, cfg.dense_layers),
            "an expert block": ({k: v for k, v in weights.items()
                                 if k not in (*stack.DENSE_MLP, stack.DENSE)}, cfg.moe_layers)}


def _held(cfg, plan, per_layer: int, stage_input: int) -> dict:
    """What a device holds at once, and the sentence that says how. Without a pipeline:
    every layer's residuals of one micro-batch (they are accumulated one at a time). A
    pipeline (jaxscale.parallel.pipeline) keeps its schedule's slots of stage inputs and of
    their gradients (the tick table's), with a split backward the boundary activations and
    gradients each waiting W holds, and recomputes one chunk's forward at a time."""
    if plan.pp == 1:
        total = per_layer * cfg.n_layers
        return {"total": total, "how": f"{per_layer:,} B a layer x {cfg.n_layers} layers"}
    t = tick_table(plan.schedule, plan.pp, plan.micro_batches, plan.virtual)
    chunk = cfg.n_layers // (plan.pp * plan.virtual)
    waiting = 2 * t.wslots * (chunk + 1)  # h_l and g_l at each boundary, per waiting W
    total = (t.slots + t.gslots + waiting) * stage_input + per_layer * chunk
    how = (f"{t.slots} stage-input and {t.gslots} gradient slots"
           + (f" + {waiting} boundary values waiting for W" if waiting else "")
           + f" x {stage_input:,} B + one chunk's backward ({chunk} layers x {per_layer:,} B)")
    return {"total": total, "how": how}


def _layer_weights(cfg, plan, dtype) -> dict:
    """One layer's parameters as one device holds them in the block: whole, except the
    dimensions tp splits (divided by tp)."""
    abstract = modellib.abstract(cfg)
    shapes = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))["blocks"]
    specs = param_specs(modellib.logical_axes(abstract), plan, cfg.kv_heads)["blocks"]

    def local(s, spec):
        dims = [n // plan.tp if TP in _names(part) else n
                for n, part in zip(s.shape, tuple(spec) + (None,) * len(s.shape))]
        return jax.ShapeDtypeStruct(tuple(dims[1:]), dtype)  # less the layers axis
    return jax.tree.map(local, shapes, specs)


def _names(part) -> tuple:
    return () if part is None else (part,) if isinstance(part, str) else tuple(part)


def _row(aval, source: str, kind: str = "") -> dict:
    """A residual as a row: its shape, dtype, bytes, and what made it (the operation and
    where in jaxscale, or the block's input; `kind`: which kind of block, if several)."""
    shape = tuple(aval.shape)
    made = "the block's input" if source == "from the argument x" else _short(source)
    made = f"({kind}) {made}" if kind else made
    return {"shape": list(shape), "dtype": str(aval.dtype),
            "bytes": int(np.prod(shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize,
            "made_by": made}


def _short(source: str) -> str:
    """'output of dot_general from /…/jaxscale/model/block.py:92:19 (attention)' ->
    'dot_general, model/block.py:92 (attention)'."""
    m = re.match(r"output of (?:jitted function )?'?(?P<op>[\w.]+)'? from "
                 r"(?:.*/jaxscale/)?(?P<file>[^:]+):(?P<line>\d+)(?::\d+)?(?: \((?P<fn>\w+)\))?",
                 source)
    if not m:
        return source
    return f"{m['op']}, {m['file']}:{m['line']}" + (f" ({m['fn']})" if m["fn"] else "")
