"""`jaxscale compare`'s work: run the strategies, then the table, markdown and charts."""
from __future__ import annotations

import sys
from pathlib import Path


def _mesh(plan: dict) -> str:
    parts = [f"{a}={plan[a]}" for a in ("dp", "tp", "pp") if plan[a] > 1] or ["1 device"]
    if plan["zero_stage"]:
        parts.append(f"ZeRO-{plan['zero_stage']}")
    if plan["pp"] > 1:
        parts.append(f"{plan['schedule']} m={plan['micro_batches']}")
    return " ".join(parts)


def run_all(cfg, plans: dict, devices, steps: int, batch_size: int) -> list[dict]:
    """Train and measure every plan on the same batches; rows with predictions beside."""
    from jaxscale import garden, optim
    from jaxscale.compare import TOLERANCE, predict, run_strategy
    from jaxscale.train import TrainConfig, as_arrays, init_state

    _, params, _ = init_state(TrainConfig(model=_preset_name(cfg)))
    it = garden.make_corpus(0, seq_len=cfg.seq_len).train_batches(batch_size, seed=1)
    batches = [as_arrays(next(it)) for _ in range(steps)]
    rows, ref = [], None
    for i, (name, plan) in enumerate(plans.items()):
        print(f"[{i + 1}/{len(plans)}] {name}: {_mesh(plan.as_dict())} ...", file=sys.stderr,
              flush=True)
        r = run_strategy(name, plan, cfg, params, batches, optim.adamw(3e-3), devices)
        r["mesh"] = _mesh(r["plan"])
        r["predicted"] = predict(cfg, plan, batches[0]["tokens"].shape)
        ref = ref or (r if name == "single" else None)
        rows.append(r)
    ref = ref or rows[0]
    for r in rows:
        r["max_rel_dloss"] = max(abs(a - b) / b for a, b in zip(r["losses"], ref["losses"]))
        r["pass"] = r["max_rel_dloss"] <= TOLERANCE
        r["step_ratio"] = r["step_s"] / ref["step_s"]
        m, p = r["memory"], r["predicted"]["states"]
        r["states_measured"] = m["params"] + m["master"] + m["optimizer"]
        r["states_predicted"] = p["params"] + p["optimizer"]
        r["sent_total"] = sum(r["sent"].values())
        r["sent_predicted_total"] = sum(r["predicted"]["sent"].values())
    return rows


def _preset_name(cfg) -> str:
    from jaxscale.model import PRESETS
    return next(k for k, v in PRESETS.items() if v == cfg)


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
        print(f"[{i + 1}/{len(plans)}] {name}: {_mesh(plan.as_dict())}, compiling ...",
              file=sys.stderr, flush=True)
        init, step = build_train_step(cfg, plan, optim.adamw(3e-3), devices[:plan.n_devices])
        state = jax.eval_shape(init, params)
        sharding = getattr(step, "batch_sharding", None)
        spec = lambda dt: jax.ShapeDtypeStruct((batch_size, cfg.seq_len), dt,  # noqa: E731
                                               sharding=sharding)
        batch = {"tokens": spec(jnp.int32), "targets": spec(jnp.int32),
                 "mask": spec(jnp.float32)}
        compiled = getattr(step, "jitted", step).lower(state, batch).compile()
        mem = measure.memory(compiled)
        pred = predict(cfg, plan, (batch_size, cfg.seq_len))["states"]
        batch_bytes = 12 * batch_size * cfg.seq_len // plan.dp
        states = mem["arguments"] - batch_bytes
        rows.append({"name": name, "plan": plan.as_dict(), "mesh": _mesh(plan.as_dict()),
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
            "pred", "compile", "step", "x 1 dev", "idle: schedule/formula"]
    rows = []
    for r in result["rows"]:
        idle = (f"{r['idle_schedule']:.3f}/{r['idle_formula']:.3f}" if "idle_schedule" in r
                else "-")
        rows.append([r["name"], r["mesh"], f"{r['max_rel_dloss']:.1e}",
                     "pass" if r["pass"] else "FAIL", _bytes(r["states_measured"]),
                     _bytes(r["states_predicted"]), _bytes(r["memory"]["temporaries"]),
                     _bytes(r["sent_total"]), _bytes(r["sent_predicted_total"]),
                     f"{r['compile_s']:.1f} s", f"{r['step_s'] * 1e3:.1f} ms",
                     f"{r['step_ratio']:.2f}", idle])
    return cols, rows


def _bytes(x: float) -> str:
    """Compact but exact enough to compare: 369k, 3.146M (bytes; k, M, G are powers of
    1000, not 1024)."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.4g}{unit}"
    return f"{x:.0f}"


def print_table(result: dict) -> None:
    """The table, in two halves that fit a 100-column terminal (correctness and memory;
    communication and time)."""
    from jaxscale.report import print_table as show
    cols, rows = table_rows(result)
    title = (f"jaxscale compare: {result['model']} on {result['devices']} devices"
             + (" (compiled only)" if result.get("abstract") else
                f", {result['steps']} steps of {result['batch_size']} documents, loss "
                f"tolerance {result['tolerance']:g}"))
    if result.get("abstract"):
        show(title, cols, rows)
        return
    first = [0, 1, 2, 3, 4, 5, 6, 12]
    show(title + " (bytes per device)", [cols[i] for i in first],
         [[row[i] for i in first] for row in rows])
    second = [0, 7, 8, 9, 10, 11]
    show("communication per device per step (measured in the HLO / predicted) and time",
         [cols[i] for i in second], [[row[i] for i in second] for row in rows])


def markdown(result: dict) -> str:
    cols, rows = table_rows(result)
    lines = [f"# jaxscale compare: {result['model']} on {result['devices']} devices", "",
             "| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    if not result.get("abstract"):
        lines += ["", "Bytes sent per device per step by collective (measured / predicted):", ""]
        for r in result["rows"]:
            ops = sorted(set(r["sent"]) | set(r["predicted"]["sent"]))
            lines.append(f"- {r['name']}: " + (", ".join(
                f"{op} {r['sent'].get(op, 0):,.0f} / {r['predicted']['sent'].get(op, 0):,.0f}"
                for op in ops) or "none"))
    return "\n".join(lines) + "\n"


def charts(result: dict, out: Path) -> None:
    """memory.png (stacked bars, measured vs predicted), bytes.png, losses.png."""
    import numpy as np

    from jaxscale.report import pyplot, save_figure
    plt = pyplot()
    rows = result["rows"]
    names = [r["name"] for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.9), 3.6))
    meas = {"params": [r["memory"]["params"] for r in rows],
            "optimizer": [r["memory"]["optimizer"] + r["memory"]["master"] for r in rows]}
    pred = {"params": [r["predicted"]["states"]["params"] for r in rows],
            "optimizer": [r["predicted"]["states"]["optimizer"] for r in rows],
            "grads": [r["predicted"]["states"]["grads"] for r in rows]}
    bottom = np.zeros(len(rows))
    for key, color in (("params", "C0"), ("optimizer", "C1")):
        ax.bar(x - 0.2, meas[key], 0.38, bottom=bottom, color=color, label=f"{key} (measured)")
        bottom += meas[key]
    bottom = np.zeros(len(rows))
    for key, color in (("params", "C0"), ("optimizer", "C1"), ("grads", "C2")):
        ax.bar(x + 0.2, pred[key], 0.38, bottom=bottom, color=color, alpha=0.45,
               label=f"{key} (predicted)")
        bottom += pred[key]
    ax.set(xticks=x, xticklabels=names, ylabel="bytes per device",
           title="model states per device: measured (left) vs predicted (right)")
    ax.legend(fontsize=6, ncol=2)
    save_figure(fig, out / "memory.png")
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.9), 3.4))
    ax.bar(x - 0.2, [max(r["sent_total"], 1) for r in rows], 0.38, label="measured (HLO)")
    ax.bar(x + 0.2, [max(r["sent_predicted_total"], 1) for r in rows], 0.38, label="predicted")
    ax.set(xticks=x, xticklabels=names, yscale="log", ylabel="bytes sent per device per step")
    ax.legend(fontsize=7)
    save_figure(fig, out / "bytes.png")
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for r in rows:
        ax.plot(np.arange(1, len(r["losses"]) + 1), r["losses"], label=r["name"], lw=1)
    ax.set(xlabel="step", ylabel="training loss (nats/token)", title="loss curves (overlaid)")
    ax.legend(fontsize=6, ncol=2)
    save_figure(fig, out / "losses.png")
