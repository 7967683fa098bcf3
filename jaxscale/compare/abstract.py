"""`jaxscale compare --abstract`: every plan lowered and compiled on abstract (never
allocated) state, in this process; XLA's per-device memory beside the formula's
(compare.predict). Nothing runs, so nothing can crash a collective.

With `--target` the devices are a TPU slice's (or GPU hosts') compile-only devices
(jaxscale.runtime.targets): the memory is the target compiler's per chip, set against the
chip's HBM, and the program's collectives are counted as that compiler left them (an async
start/done pair once), by mesh axis, with the bytes each chip sends per step beside
compare.predict's (where it models the plan).
"""
from __future__ import annotations

import sys
from collections import Counter

import jax
import jax.numpy as jnp
from flax import nnx

from jaxscale.compare.predict import params_per_device, predict, predictable, state_bytes
from jaxscale.compare.run import mesh_label
from jaxscale.costmodel.units import short_bytes
from jaxscale.measure import hlo, memory
from jaxscale.model import optim, transformer as modellib
from jaxscale.parallel.build import build_train_step
from jaxscale.parallel.tick_table import plan_branch_share
from jaxscale.runtime import target_cache


def predicted_states(cfg, plan) -> dict[str, float]:
    """The closed form's per-device model states on the parameters one device holds, by the
    policy's bytes per parameter (compare.predict.state_bytes): fp32 4 + 4 + 8, the 16-bit
    policies with fp32 master weights 2 + 2 + 12, bf16-pure 2 + 2 + 4."""
    return state_bytes(params_per_device(cfg, plan)["total"], plan)


def collective_counts(text: str, share: dict[int, float] | None = None) -> dict[str, float]:
    """Collectives the optimized program (its HLO `text`) runs per step, by kind: an async
    -start/-done pair once, an op in a loop body once per iteration, one in a pipeline's
    tick branch by its `share` of ticks (jaxscale.measure.hlo)."""
    counts: Counter = Counter()
    for op in hlo.collectives(text, share):
        counts[op.op] += op.times
    return dict(counts)


def run_abstract(cfg, plans: dict, devices, batch_size: int, target=None) -> list[dict]:
    """Lower and compile each plan on abstract (never allocated) state; XLA's memory."""
    params = nnx.to_pure_dict(nnx.state(modellib.abstract(cfg), nnx.Param))
    rows = []
    for i, (name, plan) in enumerate(plans.items()):
        print(f"[{i + 1}/{len(plans)}] {name}: {mesh_label(plan.as_dict())}, compiling"
              + (f" for {target.name}" if target else "") + " ...", file=sys.stderr, flush=True)
        init, step = build_train_step(cfg, plan, optim.adamw(3e-3), devices[:plan.n_devices])
        state = jax.eval_shape(init, params)
        if step.batch_sharding is None:  # one device's plain jit compiles where its arguments live
            one = jax.sharding.SingleDeviceSharding(devices[0])
            state = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                                                sharding=one), state)
        batch = abstract_batch(step, devices, batch_size, cfg.seq_len)
        pred = predicted_states(cfg, plan)
        try:
            lowered = step.jitted.lower(state, batch)
            compiled, source = (target_cache.compile_for(lowered, target) if target
                                else (lowered.compile(), None))
        except jax.errors.JaxRuntimeError as e:
            why = memory.refusal(e)  # the compiler's sentence, when the chip is too small
            if target is None or why is None:
                raise
            rows.append({**refused_row(name, plan, pred, target, why),
                         "compile_source": getattr(e, "compile_source", "compiled")})
            continue
        mem = memory.memory(compiled)
        batch_bytes = 12 * batch_size * cfg.seq_len // plan.rows  # rows over dp x ep
        states = mem["arguments"] - batch_bytes
        row = {"name": name, "plan": plan.as_dict(), "mesh": mesh_label(plan.as_dict()),
               "memory": mem, "states_measured": states,
               "states_predicted": pred["params"] + pred["optimizer"],
               "rel_diff": states / (pred["params"] + pred["optimizer"]) - 1,
               "grads_predicted": pred["grads"]}
        if target is not None:
            text, share = compiled.as_text(), plan_branch_share(plan)  # each made once
            row.update(target_figures(compiled, mem, target, text, share), compile_source=source)
            row.update(target_bytes(text, share, step, cfg, plan, batch_size))
        rows.append(row)
    return rows


def abstract_batch(step, devices, batch_size: int, seq: int) -> dict:
    """One batch of `batch_size` rows of `seq` tokens, never allocated, placed where the
    step takes it (one device's plain jit: on the first of `devices`)."""
    where = step.batch_sharding or jax.sharding.SingleDeviceSharding(devices[0])
    spec = lambda dtype: jax.ShapeDtypeStruct((batch_size, seq), dtype,  # noqa: E731
                                              sharding=where)
    return {"tokens": spec(jnp.int32), "targets": spec(jnp.int32), "mask": spec(jnp.float32)}


def refused_row(name: str, plan, pred: dict, target, why: str) -> dict:
    """A plan the target's compiler would not compile because it needs more memory than
    the chip has: the compiler's own sentence `why` (what it needs against what is
    available), and the closed form's states beside it."""
    return {**memory.refused_bytes(why),
            "name": name, "plan": plan.as_dict(), "mesh": mesh_label(plan.as_dict()),
            "memory": None, "states_measured": None,
            "states_predicted": pred["params"] + pred["optimizer"], "rel_diff": None,
            "grads_predicted": pred["grads"], "target": target.name,
            "hbm_bytes": target.hbm_bytes, "generated_code": None, "needed_bytes": None,
            "fits": False, "refused": why, "collectives_per_step": {},
            "collectives_by_axis": {}, "sent_by_axis": None, "sent_total": None,
            "sent_by_axis_predicted": None, "sent_predicted_total": None}


def target_figures(compiled, mem: dict, target, text: str, share=None) -> dict:
    """What a target adds to a row: the chip's HBM, XLA's figure against it, the code size
    and the collectives the TPU compiler left in the program (`text`, its optimized HLO)."""
    needed, code = memory.needed_bytes(compiled, mem)
    return {"target": target.name, "hbm_bytes": target.hbm_bytes, "generated_code": code,
            "needed_bytes": needed, "fits": needed <= target.hbm_bytes,
            "collectives_per_step": collective_counts(text, share)}


def target_bytes(text: str, share, step, cfg, plan, batch_size: int) -> dict:
    """The target program's collectives by mesh axis (count and result bytes), the ring
    bytes each chip sends per step by axis, and compare.predict's beside them where it
    models the plan (None elsewhere). The compiler may merge, split or rewrite the
    program's collectives (XLA:TPU folds the loss into the gradients' all-reduce, and may
    reduce a small ZeRO-3 slice with an all-reduce); the difference is its doing. `share`:
    a pipeline's tick-branch shares (tick_table.plan_branch_share)."""
    axes = dict(step.mesh.shape) if step.mesh is not None else {}
    sent = hlo.ring_bytes_by_axis(text, axes, share)
    pred = (predict(cfg, plan, (batch_size, cfg.seq_len))["sent_by_axis"]
            if predictable(plan, cfg) else None)
    total = lambda by_axis: sum(v for ops in by_axis.values() for v in ops.values())  # noqa: E731
    return {"collectives_by_axis": hlo.bytes_by_axis(text, axes, share), "sent_by_axis": sent,
            "sent_total": total(sent), "sent_by_axis_predicted": pred,
            "sent_predicted_total": None if pred is None else total(pred)}


def abstract_table(result: dict, fmt) -> tuple[list[str], list[list[str]]]:
    """compare's table for a compile-only run (`fmt`: bytes as text); with a target, the
    chip's figures: what XLA:TPU needs per chip, whether it fits the HBM, the collectives."""
    cols = ["strategy", "mesh", "state args (XLA)", "params+opt (formula)", "diff",
            "temporaries (XLA)", "grads (formula)"]
    def opt(x, show):
        return "-" if x is None else show(x)
    rows = [[r["name"], r["mesh"], opt(r["states_measured"], fmt), fmt(r["states_predicted"]),
             opt(r["rel_diff"], lambda x: f"{x:+.2%}"),
             opt(r["memory"], lambda m: fmt(m["temporaries"])), fmt(r["grads_predicted"])]
            for r in result["rows"]]
    if not result.get("target"):
        return cols, rows
    cols += ["code", "needed / chip", f"fits {fmt(result['hbm_bytes'])}",
             "collectives / step, by mesh axis", "sent / chip (formula)"]
    for row, r in zip(rows, result["rows"]):
        ops = "; ".join(f"{axis}: " + ", ".join(f"{op} {v['count']:g}" for op, v in sorted(
            by_op.items())) for axis, by_op in sorted(r["collectives_by_axis"].items()))
        row += [opt(r["generated_code"], fmt), opt(r["needed_bytes"], fmt),
                "yes" if r["fits"] else "NO", ops or ("-" if r.get("refused") else "none"),
                sent_cell(r, fmt)]
    return cols, rows


def sent_cell(r: dict, fmt) -> str:
    """'1.2 MB (+0.00%)': the ring bytes a chip sends per step, against the formula's."""
    x, p = r["sent_total"], r["sent_predicted_total"]
    if x is None:
        return "-"
    if p is None:
        return f"{fmt(x)} (not modelled)"
    return f"{fmt(x)} ({x / p - 1:+.2%})" if p else f"{fmt(x)} (formula 0)"


def abstract_notes(result: dict) -> list[str]:
    """The rows the target's compiler refused, in its words; where a target's program sends
    other bytes than the formula, which collectives, on which axis."""
    out = [f"{r['name']}: the compiler refused it: {r['refused']}" for r in result["rows"]
           if r.get("refused")]
    for r in result["rows"]:
        if r.get("sent_by_axis") is not None and r.get("sent_by_axis_predicted") is not None:
            if parts := bytes_apart(r["sent_by_axis"], r["sent_by_axis_predicted"]):
                out.append(f"{r['name']}: the compiled program sends other bytes than the "
                           f"formula: {'; '.join(parts)} (compiled against formula)")
    return out


def bytes_apart(sent: dict, pred: dict, rel: float = 1e-3) -> list[str]:
    """'dp all-gather 13.2 MB against 4.7 MB' for each axis and collective whose bytes
    differ by more than `rel` (the compiler merges, splits and rewrites collectives)."""
    out = []
    for axis in sorted(set(sent) | set(pred)):
        mine, theirs = sent.get(axis, {}), pred.get(axis, {})
        for op in sorted(set(mine) | set(theirs)):
            x, p = mine.get(op, 0.0), theirs.get(op, 0.0)
            if abs(x - p) > rel * max(p, 1.0):
                out.append(f"{axis} {op} {short_bytes(x) if x else 'none'} against "
                           f"{short_bytes(p) if p else 'none'}")
    return out


def target_where(result: dict) -> str:
    """'v5p-512 (256 chips, v5p:4x8x8; sequences of 4,096 tokens)'."""
    return (f"{result['target']} ({result['devices']} chips, {result['topology']}; "
            f"sequences of {result['seq']:,} tokens)")
