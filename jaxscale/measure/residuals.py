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

The collectives are left out of the trace (tp's all-reduces and the cp ring are not
differentiated here), so what a selective policy keeps of their outputs counts like the
local value it replaces. The layer's weights are not activations: the rows list the
block's input and the values made inside it.

What a device holds at once (`_held`): without a pipeline, every layer's residuals of one
micro-batch; a pipeline keeps only each stage's input for the micro-batches in flight
(jaxscale.costmodel.schedule.in_flight) and recomputes a chunk's forward in its backward,
so it adds one chunk's residuals.
"""
from __future__ import annotations

import re

import jax
import numpy as np
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals  # behind print_saved_residuals

from jaxscale.costmodel import schedule
from jaxscale.model import precision, transformer as modellib
from jaxscale.model.block import block
from jaxscale.parallel.axes import TP
from jaxscale.parallel.hybrid import param_specs


def block_residuals(cfg, plan, batch_size: int) -> dict:
    """The residuals of one block on one device of `plan` (module docstring): one row per
    saved value (shape, dtype, bytes, what made it), their sum per layer, and the total a
    device holds at its peak."""
    rows_here = batch_size // (plan.dp * plan.micro_batches)
    tokens = cfg.seq_len // plan.cp
    dtype = precision.policy(plan.precision).compute_dtype
    weights = _layer_weights(cfg, plan, dtype)
    x = jax.ShapeDtypeStruct((rows_here, tokens, cfg.d_model), dtype)

    def one_block(p, x):
        return block(p, x, None, plan.attention, None, cfg.family)
    if plan.remat != "none":
        one_block = jax.checkpoint(one_block, policy=modellib.REMAT_POLICIES[plan.remat])
    rows = [_row(aval, source) for aval, source in saved_residuals(one_block, weights, x)
            if not source.startswith(("from the argument p", "from a literal"))]
    per_layer = sum(r["bytes"] for r in rows)
    return {"rows_per_micro_batch": rows_here, "tokens": tokens, "remat": plan.remat,
            "rows": sorted(rows, key=lambda r: -r["bytes"]), "per_layer": per_layer,
            **_held(cfg, plan, per_layer, rows_here * tokens * cfg.d_model * dtype.itemsize)}


def _held(cfg, plan, per_layer: int, stage_input: int) -> dict:
    """What a device holds at once, and the sentence that says how. Without a pipeline:
    every layer's residuals of one micro-batch (they are accumulated one at a time). A
    pipeline keeps only each stage input in flight and recomputes a chunk's forward in its
    backward (jaxscale.parallel.pipeline): the inputs in flight plus one chunk's residuals."""
    if plan.pp == 1:
        total = per_layer * cfg.n_layers
        return {"total": total, "how": f"{per_layer:,} B a layer x {cfg.n_layers} layers"}
    flight = schedule.in_flight(plan.pp, plan.micro_batches, plan.schedule, plan.virtual)
    chunk = cfg.n_layers // (plan.pp * plan.virtual)
    total = int(flight * stage_input) + per_layer * chunk
    how = (f"{flight:g} stage inputs in flight x {stage_input:,} B + one chunk's backward "
           f"({chunk} layers x {per_layer:,} B)")
    if plan.schedule in schedule.ZERO_BUBBLE:
        how += "; not counted: the boundary activations a split backward keeps for W"
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


def _row(aval, source: str) -> dict:
    """A residual as a row: its shape, dtype, bytes, and what made it (the operation and
    where in jaxscale, or the block's input)."""
    shape = tuple(aval.shape)
    made = "the block's input" if source == "from the argument x" else _short(source)
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
