"""Where a layout parts ways with the single device: the step, the tensors, the layer.

compare says whether a layout's losses stay within rounding of the single device's; when
they do not, this says where the difference starts (after any run in which a strategy
misses the bound, `trace_failures`; for every strategy with `compare --trace-divergence`):

1. the step: train the layout and the single device on the same batches and find the first
   step whose loss differs by more than the bound;
2. the tensors: the parameters entering that step, layout against single device (whole
   tensors, by name), ranked by relative difference max|a - b| / max|b|. All zero means the
   parameters are still equal: the step's own computation differs;
3. the layer: with the single device's parameters entering that step on both sides (so only
   the computation can differ), the same step on a model cut to its first i blocks, i
   found by bisection: the fewest blocks whose loss already differs. Before the first
   block, one more run whose blocks write nothing into the residual stream (their output
   projections zeroed: each block is then the identity) tells the embedding, the output
   head and the loss apart from the blocks. A pipeline's cut keeps whole stages (pp x v
   blocks at a time), interleaved experts' whole groups (moe_every blocks).

A bug in the loss's reduction (a mean of per-shard means) shows at the first step with no
block; a tensor-parallel layer that averages its partial sums shows in block 0. Both are
tested (tests/compare/test_divergence.py).
"""
from __future__ import annotations


import jax
import numpy as np
import optax

from jaxscale.compare.child import WorkerError
from jaxscale.compare.run import run_all
from jaxscale.compare.strategies import CONTROL
from jaxscale.model import stack
from jaxscale.parallel.build import build_train_step
from jaxscale.parallel.plan import Plan

TOP = 5  # tensors listed
FP32_EPS = 2.0 ** -23


def rounding_bound(n_terms: int) -> float:
    """sqrt(n) eps_fp32: how far two fp32 sums of the same n terms may land apart,
    relative to the total (compare's trace uses it unless --tolerance is given)."""
    return float(np.sqrt(n_terms)) * FP32_EPS


def first_parted(rel: list[float], tolerance: float) -> int | None:
    """The first step whose relative difference is over `tolerance` or NaN, else None."""
    return next((i for i, r in enumerate(rel) if not r <= tolerance), None)


def trace(plan: Plan, cfg, params, batches: list[dict], devices, tolerance: float,
          optimizer, reference: Plan = Plan()) -> dict:
    """The report (module docstring) for `plan` against the single device's `reference`
    plan (compare's: Plan(), or Plan(precision=...) under --precision) on `batches` (whole
    host dicts, one per step) from the whole fp32 `params`."""
    layout, single = (_train(p, cfg, params, batches, devices, optimizer)
                      for p in (plan, reference))
    rel = [abs(a - b) / abs(b) for a, b in zip(layout["losses"], single["losses"])]
    step = first_parted(rel, tolerance)
    report = {"tolerance": tolerance, "first_step": step, "loss_rel_diff": rel}
    if step is None:
        return report
    report["tensors"] = _tensors(layout["params"][step], single["params"][step])
    report["layers"], report["where"] = _layers(plan, cfg, single["params"][step],
                                                batches[step], devices, tolerance, reference)
    return report


def trace_failures(spec: dict, rows: list[dict], noise: dict, log) -> list[str]:
    """Trace every strategy that ran but missed compare's bound, unless the run traced
    already (--trace-divergence), is a cluster job, or had no bound (no single-device
    run to judge by): its workers again, on those strategies only, each trained next to the
    single device (`trace`) against the same bound; row["divergence"] filled in place (an
    error or Ctrl-C leaves a note there instead). Only a failing run pays for it. Returns
    the names traced."""
    missed = [r for r in rows if r.get("status") == "ok" and r.get("pass") is False
              and r["name"] not in ("single", CONTROL) and "divergence" not in r]
    if not missed or noise.get("tolerance") is None or spec.get("trace_divergence") \
            or spec.get("cluster"):
        return []
    log(f"{', '.join(r['name'] for r in missed)} missed the bound: tracing where "
        f"{'it parts' if len(missed) == 1 else 'they part'} ways with the single device")
    again = {**spec, "strategies": [{"name": r["name"], "plan": r["plan"]} for r in missed],
             "trace_divergence": True, "tolerance": noise["tolerance"], "time_model": False,
             "repeats": 3, "save_params": None, "profile": None,
             "workers": min(spec.get("workers", 1), len(missed))}
    try:
        traced = {r["name"]: r for r in run_all(again, lambda _: None, log)}
    except (WorkerError, KeyboardInterrupt) as e:
        traced = {}
        why = "interrupted" if isinstance(e, KeyboardInterrupt) else str(e)
        log(f"jaxscale: tracing stopped ({why}); the measured run is complete")
    for r in missed:
        found = traced.get(r["name"], {})
        r["divergence"] = found.get("divergence") or {
            "error": found.get("error", "the trace did not finish")}
    return [r["name"] for r in missed]


def notes(result: dict) -> list[str]:
    """compare's lines on where each traced strategy parts ways (or a hint to trace)."""
    out = []
    for r in result["rows"]:
        d = r.get("divergence")
        if d is not None and "error" in d:
            out.append(f"{r['name']} misses the bound; tracing where it parts ways failed: "
                       f"{d['error']}")
        elif d is not None and d["first_step"] is not None:
            top = ", ".join(f"{t['tensor']} {t['rel_diff']:.2g}" for t in d["tensors"][:3])
            out.append(f"{r['name']} parts ways at step {d['first_step']} (loss "
                       f"{d['loss_rel_diff'][d['first_step']]:.2g} relative, bound "
                       f"{d['tolerance']:.2g}): {d['where']}; parameters entering it: {top}")
        elif d is not None:
            out.append(f"{r['name']}: traced, follows the single device within "
                       f"{d['tolerance']:.2g} at every step")
        elif r.get("status") == "ok" and r.get("pass") is False and r["name"] != "single":
            out.append(f"{r['name']} misses the bound: run it again with --trace-divergence "
                       "to see the step, the tensors and the layer where it parts ways")
    return out


def _train(plan, cfg, params, batches, devices, optimizer) -> dict:
    """Losses and the whole parameters entering each step, on the host."""
    init, step = build_train_step(cfg, plan, optimizer, devices[:plan.n_devices])
    state, losses, entering = init(params), [], []
    for batch in batches:
        entering.append(jax.device_get(step.full_params(state)))
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return {"losses": losses, "params": entering}


def _tensors(layout: dict, single: dict) -> list[dict]:
    """The TOP parameters that differ most, by relative difference."""
    rows = []
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(layout), jax.tree.leaves(single)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        scale = float(np.max(np.abs(b))) or 1.0
        rows.append({"tensor": "/".join(str(k.key) for k in path),
                     "rel_diff": float(np.max(np.abs(a - b))) / scale})
    return sorted(rows, key=lambda r: -r["rel_diff"])[:TOP]


def _layers(plan, cfg, params, batch, devices, tolerance, reference: Plan = Plan()
            ) -> tuple[list[dict], str]:
    """Each cut tried (blocks kept, relative loss difference) and the sentence it leads to."""
    # a pipeline's cut keeps whole stages; interleaved experts, whole groups of blocks
    unit = plan.pp * plan.virtual * cfg.moe_every
    tried = []

    def differs(blocks: int, silent: bool = False) -> bool:
        a, b = (_loss(p, cfg, params, batch, devices, blocks, silent) for p in (plan, reference))
        tried.append({"blocks": 0 if silent else blocks, "rel_diff": abs(a - b) / abs(b)})
        return tried[-1]["rel_diff"] > tolerance

    if differs(unit, silent=True):
        return tried, ("before the blocks: the embedding, the output head or the loss (with "
                       "every block the identity, the loss already differs)")
    lo, hi = 0, cfg.n_layers // unit  # cuts in whole units: lo agrees, hi is to be seen
    if not differs(hi * unit):
        return tried, ("not in the step's computation: with equal parameters every cut agrees, "
                       "so the parameters carried into the step differ (see the tensors)")
    while hi - lo > 1:  # the fewest units that differ
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if differs(mid * unit) else (mid, hi)
    first = lo * unit
    return tried, (f"in block {first}" if unit == 1 else
                   f"in blocks {first}-{first + unit - 1} (one "
                   f"{'pipeline unit' if plan.pp > 1 else 'group of dense and expert blocks'})")


def _loss(plan, cfg, params, batch, devices, blocks: int, silent: bool) -> float:
    """The loss of one step of `plan` on a model of the first `blocks` blocks (silent:
    their output projections zeroed, each block the identity)."""
    cut = stack.first(params["blocks"], blocks)
    if silent:
        cut = stack.silent(cut, lambda v: jax.tree.map(np.zeros_like, v))
    init, step = build_train_step(cfg.first_blocks(blocks), plan,
                                  optax.sgd(0.0), devices[:plan.n_devices])
    _, metrics = step(init({**params, "blocks": cut}), batch)
    return float(metrics["loss"])
