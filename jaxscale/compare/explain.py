"""Where every tensor of a layout's training state lives: `jaxscale explain`.

A layout (a Plan) decides, for each tensor the training step keeps between steps, which
mesh axes split it and which hold copies. This module builds the plan's state (on the
devices given) and reads each array's sharding:

  name, kind        the parameter's path; parameter, master weight (fp32, for 16-bit
                    policies), optimizer slot (mu, nu, trace, ...), counter (scalars), or
                    amax history (fp8-delayed's, per product: jaxscale.model.fp8_history)
  logical axes      the model's names for the parameter's dimensions ("flat" or
                    "reshaped" where a layout keeps its own shape: ZeRO-1/2's slices)
  spec              its PartitionSpec on the mesh: which mesh axis splits which dimension
  per device        the shape of one device's piece, its dtype and bytes
  replicas          how many devices hold the same piece: 1 = sharded over every device,
                    the device count = whole on every device
  flag              a tensor the plan's ZeRO stage should split over dp but that each dp
                    replica holds whole (what silently costs memory)

The state is never allocated: its shapes come from jax.eval_shape, its shardings are
those the plan keeps it in (what a checkpoint restore puts it in), so the same rows come for forced host devices and for
a compile-only target's (`--target`). The per-device bytes come from the shardings' shapes
(shard_shape x itemsize); their total over parameters, master weights and optimizer slots
is the model state that `jaxscale compare` measures from the buffers on its first device,
which tests/compare/test_explain.py checks to the byte. Gradients live only inside the
step; their rows (`gradients`) follow the layout's own reduction rule.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxscale.model import optim, precision, transformer as modellib
from jaxscale.parallel.axes import DP
from jaxscale.parallel.build import build_train_step
from jaxscale.parallel.plan import Plan

PERSISTENT = ("parameter", "master weight", "optimizer slot")  # compare's model state
TRANSIENT = ("gradient", "accumulator", "reduced gradient")  # inside the step only
HISTORY = "amax history"  # fp8-delayed's: per tensor, not a model state compare measures
HISTORY_AXES = ("layers", "operand", "step")  # a history's dimensions (fp8_history)
KINDS = (*PERSISTENT, "counter", *TRANSIENT, HISTORY)


def build(cfg, plan: Plan, devices, optimizer=None):
    """(the plan's step, its initial state placed but never allocated) on `devices`
    (forced host devices, or a target's compile-only ones); `optimizer` defaults to
    compare's AdamW."""
    init, step = build_train_step(cfg, plan, optimizer or optim.adamw(3e-3),
                                  list(devices)[:plan.n_devices])
    return step, placed_state(init, step, cfg, devices)


def tensors(cfg, plan: Plan, step, state) -> list[dict]:
    """One row per array of the plan's training state (module docstring), then its
    gradient rows (`gradients`); `step, state` from `build`."""
    axes = modellib.logical_axes(modellib.abstract(cfg))
    rows = [_row(path, x, axes) for path, x in jax.tree_util.tree_leaves_with_path(state)]
    for r in rows:
        r["flag"] = _unsharded(r, plan)
    return rows + gradients(rows, plan, step.canonical.layout.reduction(),
                            precision.policy(plan.precision))


def placed_state(init, step, cfg, devices):
    """The state `init` makes, never allocated: its shapes (eval_shape) on the shardings
    the plan keeps it in (its Canonical's; one device: the first of `devices`)."""
    params = nnx.to_pure_dict(nnx.state(modellib.abstract(cfg), nnx.Param))
    shapes = jax.eval_shape(init, jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), params))
    if step.mesh is None:
        one = jax.sharding.SingleDeviceSharding(devices[0])
        shardings = jax.tree.map(lambda _: one, shapes)
    else:
        shardings = step.canonical.state_shardings
        if isinstance(shardings, jax.sharding.Sharding):  # one for the whole state
            shardings = jax.tree.map(lambda _: step.canonical.state_shardings, shapes)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, shardings)


def gradients(rows: list[dict], plan: Plan, reduction, pol) -> list[dict]:
    """The gradients' rows, one per parameter and kind, from the layout's own reduction
    (jaxscale.parallel.layouts.GradReduction); they live only inside the step:

      gradient          what backward gives each device for its own copy of the parameter
                        (the parameter's piece and dtype; ZeRO-3: its slice, since autodiff
                        reduce-scatters through the gather)
      accumulator       the sum over micro-batches (pipeline ticks), when there are several:
                        the slot's slice if the layout reduces every micro-batch (ZeRO-2),
                        else the gradient's piece
      reduced gradient  what the optimizer applies after the dp reduction: the optimizer
                        slot's piece, fp32 (16-bit policies without a master: their dtype)
    """
    slots = {}
    for r in rows:
        if r["kind"] == "optimizer slot":
            slots.setdefault(r["name"], r)
    out = []
    for p in (r for r in rows if r["kind"] == "parameter"):
        slot = slots.get(p["name"], p)
        out.append(_like(p, p, "gradient", p["dtype"]))
        if plan.micro_batches > 1 or plan.pp > 1:
            sliced = reduction.reduce is None or reduction.every_micro
            out.append(_like(p, slot if sliced else p, "accumulator", p["dtype"]))
        reduced = "float32" if pol.master_weights or p["dtype"] == "float32" else p["dtype"]
        out.append(_like(p, slot, "reduced gradient", reduced))
    return out


def _like(param: dict, placed: dict, kind: str, dtype: str) -> dict:
    """A gradient row: the parameter's name and logical axes, placed like `placed`."""
    return {**placed, "name": param["name"], "kind": kind, "slot": None, "flag": None,
            "logical_axes": placed["logical_axes"], "dtype": dtype,
            "bytes_per_device": math.prod(placed["per_device_shape"]) *
            np.dtype(dtype).itemsize}


def _unsharded(row: dict, plan: Plan) -> str | None:
    """A note if the tensor is whole across the dp replicas although the plan's ZeRO stage
    shards its kind over dp (1: optimizer slots and master weights; 3: parameters too):
    every dp replica would then hold a copy the stage promised to split."""
    sharded = {"optimizer slot", "master weight"} | ({"parameter"} if plan.zero_stage == 3
                                                     else set())
    if plan.zero_stage and plan.dp > 1 and row["kind"] in sharded and \
            DP not in row["mesh_axes"]:
        return f"whole on each dp replica, but ZeRO-{plan.zero_stage} shards it over dp"
    return None


def _row(path, x, axes) -> dict:
    # dictionary keys name the parameter; attribute names are the state's own structure
    # (TrainState's field, then optax's: ScaleByAdamState.mu, ...), the last one the slot
    top = path[0].name
    param_path = [k.key for k in path[1:] if isinstance(k, jax.tree_util.DictKey)]
    fields = [k.name for k in path[1:] if isinstance(k, jax.tree_util.GetAttrKey)]
    slot = fields[-1] if fields else None
    # a counter is named by its whole path: a chained optimizer has one count per link
    where = [str(getattr(k, "name", getattr(k, "idx", getattr(k, "key", k))))
             for k in path[1:]]
    if x.ndim == 0:
        kind = "counter"
    else:
        kind = {"params": "parameter", "master": "master weight",
                "fp8": HISTORY}.get(top, "optimizer slot")
    logical = _lookup(axes, param_path) if kind != HISTORY else HISTORY_AXES[-x.ndim:]
    if kind == HISTORY:  # named apart from the weight whose product it scales
        param_path = ["fp8", *param_path]
    sharding = x.sharding
    piece = _piece_shape(x)
    holders = sharding.devices_indices_map(x.shape)
    distinct = {tuple((s.start, s.stop) for s in index) for index in holders.values()}
    if logical is not None and len(logical) != x.ndim:  # ZeRO-1/2 keep slots as slices
        logical = "flat" if x.ndim == 1 else "reshaped"
    return {"name": "/".join(param_path) or "/".join([top, *where]), "kind": kind,
            "slot": slot if kind == "optimizer slot" else None,
            "logical_axes": logical if logical is None or isinstance(logical, str)
            else list(logical),
            "spec": _spec_text(sharding), "mesh_axes": _mesh_axes(sharding),
            "shape": list(x.shape), "per_device_shape":
            list(piece), "dtype": str(x.dtype), "bytes_per_device": math.prod(piece) *
            np.dtype(x.dtype).itemsize, "devices": len(holders),
            "replicas": len(holders) // len(distinct)}


def _lookup(axes, path):
    """The logical axes of the parameter at `path` in the model's nested dict, or None."""
    node = axes
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node if isinstance(node, tuple) else None


def _piece_shape(x) -> tuple[int, ...]:
    """One device's piece of x: from the sharding where it divides evenly, else the
    largest piece a device holds."""
    try:
        return tuple(x.sharding.shard_shape(x.shape))
    except ValueError:
        pieces = x.sharding.devices_indices_map(x.shape).values()
        return max((tuple(len(range(*s.indices(n))) for s, n in zip(index, x.shape))
                    for index in pieces), key=math.prod)


def _mesh_axes(sharding) -> list[str]:
    """The mesh axes that split the tensor (none: whole on every device)."""
    spec = getattr(sharding, "spec", None) or ()
    return [a for p in spec if p is not None for a in ((p,) if isinstance(p, str) else p)]


def _spec_text(sharding) -> str:
    spec = getattr(sharding, "spec", None)
    if spec is None:
        return "whole" if sharding.is_fully_replicated else type(sharding).__name__
    parts = ["None" if p is None else p if isinstance(p, str) else "(" + ",".join(p) + ")"
             for p in spec]
    while parts and parts[-1] == "None":  # P(tp, None) places as P(tp)
        parts.pop()
    return "P(" + ", ".join(parts) + ")"


def totals(rows: list[dict]) -> dict:
    """Bytes per device by kind, and the model state (parameters + master weights +
    optimizer slots) that compare measures."""
    by_kind = {k: sum(r["bytes_per_device"] for r in rows if r["kind"] == k)
               for k in KINDS}
    return {**by_kind, "model_state": sum(by_kind[k] for k in PERSISTENT)}


def differences(a: list[dict], b: list[dict]) -> list[dict]:
    """The tensors whose placement or per-device bytes differ between two plans' rows, by
    (kind, slot, name); a tensor only one plan keeps (a master weight) is listed too."""
    key = lambda r: (r["kind"], r["slot"] or "", r["name"])  # noqa: E731
    left, right = {key(r): r for r in a}, {key(r): r for r in b}
    out = []
    for k in sorted(set(left) | set(right)):
        x, y = left.get(k), right.get(k)
        fields = ("spec", "per_device_shape", "bytes_per_device", "replicas", "dtype")
        if x is None or y is None or any(x[f] != y[f] for f in fields):
            out.append({"kind": k[0], "slot": k[1] or None, "name": k[2], "a": x, "b": y})
    return out
