"""`jaxscale compare`'s figures: derived columns, the table, the markdown (charts:
charts.py; the runs themselves: run.py and worker.py; a compile-only run: abstract.py).

Under several processes the communication table gains "cross-proc/step": the bytes per device
per step that leave the process, measured from the HLO's replica groups and the device-to-
process map (`measure.ring_bytes_by_op(..., device_process=...)`), next to a prediction
(crossing.py). One-process runs show no such column."""
from __future__ import annotations

import json
import sys
from functools import partial

from jaxscale.compare.abstract import abstract_notes, abstract_table, target_where
from jaxscale.compare.crossing import (  # noqa: F401 (compare.report's names before)
    _device_process, axis_crossing_share, group_crossing_share, predict_cross_process,
    predicted_by_axis)
from jaxscale.compare.time_model import add_predictions
from jaxscale.model import config as model_config
from jaxscale.report import print_table as show


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
    add_predictions(result, model_config.preset(result["model"]))
    if not multiprocess(result):
        return
    procs, cfg = _device_process(result), model_config.preset(result["model"])
    for r in rows:
        cross = r.get("sent_cross_process")
        if cross is None and not r["sent"]:  # no mesh (the single device): nothing to cross
            cross = r["sent_cross_process"] = {}
        r["cross_total"] = None if cross is None else sum(cross.values())
        pred = None
        if r["predicted"] and procs is not None:
            pred = predict_cross_process(cfg, r["plan"], (result["batch_size"], cfg.seq_len),
                                         procs, r["predicted"]["sent"])
        r["sent_cross_process_predicted"] = pred
        r["cross_predicted_total"] = None if pred is None else sum(pred.values())


def multiprocess(result: dict) -> bool:
    """Whether the run was one job of several processes (then bytes can leave a process)."""
    return (result.get("processes") or 1) > 1 or any(
        "sent_cross_process" in r for r in result.get("rows", []))


def _gb(x: float) -> str:
    return _bytes(x)  # powers of 1000: kB, MB, GB


def table_rows(result: dict) -> tuple[list[str], list[list[str]]]:
    if result.get("abstract"):
        return abstract_table(result, _gb)
    cross = multiprocess(result)
    cols = ["strategy", "mesh", "max dloss", "ok", "states/dev", "pred", "temps", "sent/step",
            "pred", *(["cross-proc/step", "pred"] if cross else []), "compile",
            "step (quartiles)", "x 1 dev", "step pred", "meas/pred", "s: build/HLO/steps",
            "idle: schedule/formula"]
    rows = []
    for r in result["rows"]:
        if r["status"] != "ok":
            rows.append([r["name"], r["mesh"], "-", "FAILED", *["-"] * (len(cols) - 4)])
            continue
        idle = (f"{r['idle_schedule']:.3f}/{r['idle_formula']:.3f}" if "idle_schedule" in r
                else "-")
        opt = lambda x: "-" if x is None else _bytes(x)  # noqa: E731 - not modelled
        step = (f"{r['step_s'] * 1e3:.1f} ms ({r['step_s_q1'] * 1e3:.1f}-"
                f"{r['step_s_q3'] * 1e3:.1f})" if r["step_s"] else "-")
        dloss = f"{r['max_rel_dloss']:.1e}" if "max_rel_dloss" in r else "-"  # no reference
        rows.append([r["name"], r["mesh"], dloss,
                     "pass" if r["pass"] else "FAIL", _bytes(r["states_measured"]),
                     opt(r["states_predicted"]), _bytes(r["memory"]["temporaries"]),
                     _bytes(r["sent_total"]), opt(r["sent_predicted_total"]),
                     *([opt(r.get("cross_total")), opt(r.get("cross_predicted_total"))]
                       if cross else []),
                     f"{r['compile_s']:.1f} s {'(cache)' if r['compile_source'] == 'cache' else ''}"
                     .strip(), step, "-" if r["step_ratio"] is None else f"{r['step_ratio']:.2f}",
                     "-" if not r.get("step_s_predicted") else f"{r['step_s_predicted'] * 1e3:.2g} ms",
                     "-" if not r.get("step_measured_over_predicted")
                     else f"{r['step_measured_over_predicted']:.3g}", _row_wall(r), idle])
    return cols, rows


def _row_wall(r: dict) -> str:
    """A row's own wall time: building it (setup, trace and lower, compile) / reading its
    HLO and memory / its steps (trained and timed), seconds (compare.phases)."""
    w = r.get("wall")
    if not w:
        return "-"
    build = w.get("setup_s", 0) + w.get("lower_s", 0) + w.get("compile_s", 0)
    return f"{build:.1f}/{w.get('hlo_s', 0):.1f}/{w.get('train_s', 0) + w.get('timing_s', 0):.1f}"


def wall_note(w: dict) -> str:
    """The run's wall time split (compare.run.wall_split) in one line."""
    rs = w["rows_s"]
    return (f"wall {w['total_s']:.1f} s = start {w['startup_s']:.1f} + compile phase "
            f"{w['compile_phase_s']:.1f} ({w['workers']} worker"
            f"{'s at once' if w['workers'] > 1 else ''}; summed over rows: set-up "
            f"{rs['setup_s']:.1f}, trace and lower {rs['lower_s']:.1f}, compile "
            f"{rs['compile_s']:.1f}, HLO and memory analysis {rs['hlo_s']:.1f}, training steps "
            f"{rs['train_s']:.1f}) + timing phase {w['timing_phase_s']:.1f} (calibration "
            f"{rs['calibration_s']:.1f}, timed steps {rs['timing_s']:.1f}, nothing else "
            f"running) + other {w['other_s']:.1f}")


def _bytes(x: float) -> str:
    """Compact but exact enough to compare, always with its unit: 369 kB, 3.146 MB, 512 B
    (k, M, G are powers of 1000, not 1024)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.4g} {unit}"
    return f"{x:.0f} B"


def notes(result: dict) -> list[str]:
    """What a reader needs to read the table right: the bound and where it came from, the
    failures and why, and what the timings share."""
    if result.get("abstract"):
        return abstract_notes(result)
    n = result["noise"]
    out = [f"loss bound {n['tolerance']:.2g} relative: {n['why']}" if n["tolerance"] is not None
           else n["why"]]
    out += [f"{r['name']} FAILED: {r['error']}" for r in result["rows"] if r["status"] != "ok"]
    out.append(f"step times: median (quartiles) of the timed repeats; the {result['devices']} "
               f"forced CPU devices share this host's {result['cores']} cores, so ratios to "
               "one device measure overheads, not speed-ups")
    tm = result.get("time_model") or {}
    cal = tm.get("calibration")
    if cal and tm.get("rows"):
        link = (f", all-reduce {cal['bytes_per_s'] / 1e9:.3g} GB/s per device and "
                f"{cal['latency_s'] * 1e6:.3g} us per collective"
                if cal.get("bytes_per_s") else "")
        rho = tm["rank_agreement"]
        out.append(f"step pred: FLOPs / {cal['flops_per_s'] / 1e9:.3g} GFLOP/s (a {cal['matmul_n']}"
                   f"-wide matmul, measured) + the HLO's collectives x latency + predicted "
                   f"bytes / the measured link{link}; "
                   f"measured / predicted median {tm['median_measured_over_predicted']:.3g} "
                   "(dispatch and small ops, which the model does not count)"
                   + ("" if rho is None else f"; rank agreement (Spearman) {rho:.2f} over "
                      f"{tm['rows']} strategies"))
    if multiprocess(result):
        out.append(CROSS_NOTE.format(processes=result.get("processes") or "several"))
    if result.get("wall"):
        out.append(wall_note(result["wall"]))
    return out


CROSS_NOTE = ("cross-proc/step: bytes per device per step that leave the process ({processes} "
              "processes): ring hops between devices of two processes, from the HLO's replica "
              "groups and the device-to-process map / predicted: each collective's predicted "
              "bytes x the share of its axis's hops that cross, given the placement (tp "
              "inside a process, then pp, dp across); '-': not modelled")


def print_table(result: dict) -> None:
    """The table by topic (correctness and memory; communication and time), each part split
    further into column groups where the terminal is narrower (jaxscale.report.print_table),
    then the notes."""
    cols, rows = table_rows(result)
    title = (f"jaxscale compare: {result['model']} on {_where(result)}"
             + (" (compiled only)" if result.get("abstract") else
                f", {result['steps']} steps of {result['batch_size']} documents"))
    (show if result.get("abstract") else partial(_show_parts, result))(title, cols, rows)
    for line in notes(result):
        print(line, file=sys.stderr)


def _show_parts(result: dict, title: str, cols: list[str], rows: list[list[str]]) -> None:
    last = len(cols) - 1  # the idle share
    first = [0, 1, 2, 3, 4, 5, 6, last]
    show(title + " (bytes per device)", [cols[i] for i in first],
         [[row[i] for i in first] for row in rows])
    time = [0, *range(cols.index("compile"), last)]  # compile .. s: build/HLO/steps
    comm = [0, *range(7, time[1])]  # sent/step, pred (and cross-proc/step, pred)
    halves = ([comm, time] if multiprocess(result)  # with cross-proc, time gets its own table
              else [comm + time[1:]])
    titles = (["communication per device per step (measured in the HLO / predicted)", "time"]
              if len(halves) == 2 else
              ["communication per device per step (measured in the HLO / predicted) and time"])
    for part, name in zip(halves, titles):
        show(name, [cols[i] for i in part], [[row[i] for i in part] for row in rows])


def print_partial(result: dict, as_json: bool, save=None) -> None:
    """An interrupted run (Ctrl-C): the rows finished so far, saved (`save(rows)`), then as
    the table, or with --json as the JSON ("complete": false), on stdout as a finished
    run's are."""
    if save is not None:
        save(result["rows"])
    finish(result)
    if as_json:
        print(json.dumps(result))
    elif result["rows"]:
        print_table(result)


def markdown(result: dict) -> str:
    cols, rows = table_rows(result)
    lines = [f"# jaxscale compare: {result['model']} on {_where(result)}", "",
             "| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines += [""] + [f"- {line}" for line in notes(result)]
    if not result.get("abstract"):
        lines += ["", "Bytes sent per device per step by collective (measured / predicted):", ""]
        for r in result["rows"]:
            if r["status"] != "ok":
                continue
            pred = r["predicted"]["sent"] if r["predicted"] else None
            lines.append(f"- {r['name']}: " + _by_op(r["sent"], pred))
        if multiprocess(result):
            lines += ["", "Of which cross a process boundary (measured / predicted):", ""]
            lines += [f"- {r['name']}: " + ("not measured" if r.get("sent_cross_process") is None
                                            else _by_op(r["sent_cross_process"],
                                                        r.get("sent_cross_process_predicted")))
                      for r in result["rows"] if r["status"] == "ok"]
    return "\n".join(lines) + "\n"


def _where(result: dict) -> str:
    """'8 devices', '8 devices in 2 processes', or a target's chips (abstract.target_where)."""
    if result.get("target"):
        return target_where(result)
    p = result.get("processes")
    return f"{result['devices']} devices" + (f" in {p} processes" if p and p > 1 else "")


def _by_op(measured: dict, predicted: dict | None) -> str:
    """'all-reduce 215,264 / 215,264, ...' (predicted None: 'not modelled'), or 'none'."""
    ops = sorted(set(measured) | set(predicted or {}))
    return ", ".join(f"{op} {measured.get(op, 0):,.0f} / "
                     + (f"{predicted.get(op, 0):,.0f}" if predicted is not None
                        else "not modelled") for op in ops) or "none"
