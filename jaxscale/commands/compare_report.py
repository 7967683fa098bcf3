"""`jaxscale compare`'s figures: derived columns, the table, the markdown (charts:
compare_charts.py; the runs themselves: compare_runner.py)."""
from __future__ import annotations

import sys

from jaxscale.commands.compare_runner import mesh_label


def finish(result: dict) -> None:
    """The columns derived from each measured row: ratios to the single device, totals."""
    rows = [r for r in result["rows"] if r["status"] == "ok"]
    ref = next((r for r in rows if r["name"] == "single"), None)
    for r in rows:
        r["step_ratio"] = (r["step_s"] / ref["step_s"] if ref is not None and r["step_s"]
                           else None)
        m = r["memory"]
        r["states_measured"] = m["params"] + m["master"] + m["optimizer"]
        r["sent_total"] = sum(r["sent"].values())
        p = r["predicted"]
        r["states_predicted"] = p["states"]["params"] + p["states"]["optimizer"] if p else None
        r["sent_predicted_total"] = sum(p["sent"].values()) if p else None


def run_abstract(cfg, plans: dict, devices, batch_size: int) -> list[dict]:
    """Lower and compile each plan on abstract (never allocated) state; XLA's memory."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxscale import measure, optim
    from jaxscale import model as modellib
    from jaxscale.compare import predict
    from jaxscale.parallel.plan import build_train_step

    params = nnx.to_pure_dict(nnx.state(modellib.abstract(cfg), nnx.Param))
    rows = []
    for i, (name, plan) in enumerate(plans.items()):
        print(f"[{i + 1}/{len(plans)}] {name}: {mesh_label(plan.as_dict())}, compiling ...",
              file=sys.stderr, flush=True)
        init, step = build_train_step(cfg, plan, optim.adamw(3e-3), devices[:plan.n_devices])
        state = jax.eval_shape(init, params)
        sharding = step.batch_sharding
        spec = lambda dt: jax.ShapeDtypeStruct((batch_size, cfg.seq_len), dt,  # noqa: E731
                                               sharding=sharding)
        batch = {"tokens": spec(jnp.int32), "targets": spec(jnp.int32),
                 "mask": spec(jnp.float32)}
        compiled = step.jitted.lower(state, batch).compile()
        mem = measure.memory(compiled)
        pred = predict(cfg, plan, (batch_size, cfg.seq_len))["states"]
        batch_bytes = 12 * batch_size * cfg.seq_len // plan.dp
        states = mem["arguments"] - batch_bytes
        rows.append({"name": name, "plan": plan.as_dict(), "mesh": mesh_label(plan.as_dict()),
                     "memory": mem, "states_measured": states,
                     "states_predicted": pred["params"] + pred["optimizer"],
                     "rel_diff": states / (pred["params"] + pred["optimizer"]) - 1,
                     "grads_predicted": pred["grads"]})
    return rows


def _gb(x: float) -> str:
    return _bytes(x) + "B"  # powers of 1000: kB, MB, GB


def table_rows(result: dict) -> tuple[list[str], list[list[str]]]:
    if result.get("abstract"):
        cols = ["strategy", "mesh", "state args (XLA)", "params+opt (formula)", "diff",
                "temporaries (XLA)", "grads (formula)"]
        return cols, [[r["name"], r["mesh"], _gb(r["states_measured"]), _gb(r["states_predicted"]),
                       f"{r['rel_diff']:+.2%}", _gb(r["memory"]["temporaries"]),
                       _gb(r["grads_predicted"])] for r in result["rows"]]
    cols = ["strategy", "mesh", "max dloss", "ok", "states/dev", "pred", "temps", "sent/step",
            "pred", "compile", "step (quartiles)", "x 1 dev", "idle: schedule/formula"]
    rows = []
    for r in result["rows"]:
        if r["status"] != "ok":
            rows.append([r["name"], r["mesh"], "-", "FAILED", *["-"] * 9])
            continue
        idle = (f"{r['idle_schedule']:.3f}/{r['idle_formula']:.3f}" if "idle_schedule" in r
                else "-")
        opt = lambda x: "-" if x is None else _bytes(x)  # noqa: E731 - not modelled
        step = (f"{r['step_s'] * 1e3:.1f} ms ({r['step_s_q1'] * 1e3:.1f}-"
                f"{r['step_s_q3'] * 1e3:.1f})" if r["step_s"] else "-")
        rows.append([r["name"], r["mesh"], f"{r['max_rel_dloss']:.1e}",
                     "pass" if r["pass"] else "FAIL", _bytes(r["states_measured"]),
                     opt(r["states_predicted"]), _bytes(r["memory"]["temporaries"]),
                     _bytes(r["sent_total"]), opt(r["sent_predicted_total"]),
                     f"{r['compile_s']:.1f} s {'(cache)' if r['compile_source'] == 'cache' else ''}"
                     .strip(), step, "-" if r["step_ratio"] is None else f"{r['step_ratio']:.2f}",
                     idle])
    return cols, rows


def _bytes(x: float) -> str:
    """Compact but exact enough to compare: 369k, 3.146M (bytes; k, M, G are powers of
    1000, not 1024)."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.4g}{unit}"
    return f"{x:.0f}"


def notes(result: dict) -> list[str]:
    """What a reader needs to read the table right: the bound and where it came from, the
    failures and why, and what the timings share."""
    if result.get("abstract"):
        return []
    n = result["noise"]
    out = [f"loss bound {n['tolerance']:.2g} relative: {n['why']}" if n["tolerance"] is not None
           else n["why"]]
    out += [f"{r['name']} FAILED: {r['error']}" for r in result["rows"] if r["status"] != "ok"]
    out.append(f"step times: median (quartiles) of the timed repeats; the {result['devices']} "
               f"forced CPU devices share this host's {result['cores']} cores, so ratios to "
               "one device measure overheads, not speed-ups")
    return out


def print_table(result: dict) -> None:
    """The table, in two halves that fit a 100-column terminal (correctness and memory;
    communication and time), then the notes."""
    from jaxscale.report import print_table as show
    cols, rows = table_rows(result)
    title = (f"jaxscale compare: {result['model']} on {result['devices']} devices"
             + (" (compiled only)" if result.get("abstract") else
                f", {result['steps']} steps of {result['batch_size']} documents"))
    if result.get("abstract"):
        show(title, cols, rows)
        return
    first = [0, 1, 2, 3, 4, 5, 6, 12]
    show(title + " (bytes per device)", [cols[i] for i in first],
         [[row[i] for i in first] for row in rows])
    second = [0, 7, 8, 9, 10, 11]
    show("communication per device per step (measured in the HLO / predicted) and time",
         [cols[i] for i in second], [[row[i] for i in second] for row in rows])
    for line in notes(result):
        print(line, file=sys.stderr)


def markdown(result: dict) -> str:
    cols, rows = table_rows(result)
    lines = [f"# jaxscale compare: {result['model']} on {result['devices']} devices", "",
             "| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines += [""] + [f"- {line}" for line in notes(result)]
    if not result.get("abstract"):
        lines += ["", "Bytes sent per device per step by collective (measured / predicted):", ""]
        for r in result["rows"]:
            if r["status"] != "ok":
                continue
            pred = (r["predicted"] or {}).get("sent", {})
            ops = sorted(set(r["sent"]) | set(pred))
            lines.append(f"- {r['name']}: " + (", ".join(
                f"{op} {r['sent'].get(op, 0):,.0f} / "
                + (f"{pred.get(op, 0):,.0f}" if r["predicted"] else "not modelled")
                for op in ops) or "none"))
    return "\n".join(lines) + "\n"
