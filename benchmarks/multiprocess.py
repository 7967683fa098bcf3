"""Benchmark: one job of 2 processes x 4 devices against 1 process x 8 devices, per strategy.

    python benchmarks/multiprocess.py [--rounds 2] [--steps 20] [--repeats 15] [--strategies L]

Drives the CLI as a user would, in fresh processes: `jaxscale compare --devices 8 --json`
(one process, XLA's in-process collectives) and `jaxscale launch --processes 2
--devices-per-process 4 -- compare --json` (two processes forming one jax.distributed job;
collectives between them over gloo, TCP on localhost), each with compare's default strategy
set on 8 devices, the tiny model and the same batches. The two configurations alternate
round-robin (1x8 then 2x4, then 2x4 then 1x8, ...) so that both meet the same machine load;
one compilation cache in a temporary folder serves both (never $HOME).

Per strategy it records: the step time of each configuration (median over the rounds of
compare's own median over --repeats timed steps) and the median over rounds of the 2x4 / 1x8
ratio; the bytes each device sends per step, from the HLO, split into within-process and
cross-process (the 2x4 job's device-to-process map), next to the cost model's prediction;
and the worst relative loss difference between the 2x4 and the 1x8 run at any step (the
equivalence figure: both see the same batches, so it is rounding alone, gloo reducing in
another order than the in-process runtime). Writes benchmarks/results/multiprocess.json and
prints a table.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROCESSES, PER_PROCESS = 2, 4
DEVICES = PROCESSES * PER_PROCESS
LIMIT_S = 1800  # one whole compare run; a cold 2 x 4 run of every strategy takes ~5 min here
CONFIGS = ("1x8", "2x4")
# Once a CPU collectives implementation is set (jaxscale sets gloo for several processes),
# XLA's CPU runtime runs every collective with it (cpu_runtime.cc GetCollectivesImpl), also
# those among one process's own devices.
TRANSPORT = {"1x8": "one process: XLA's in-process CPU collectives (shared memory)",
             "2x4": "two processes of one jax.distributed job: every collective over gloo, "
                    "TCP on localhost (127.0.0.1), also those among one process's own devices "
                    "(once gloo is set, XLA's CPU runtime uses it for all collectives)"}


def commands(jaxscale: str, tmp: Path, steps: int, repeats: int,
             strategies: str | None = None) -> dict[str, list[str]]:
    """The two command lines, exactly as a user types them."""
    common = ["--steps", str(steps), "--repeats", str(repeats), "--json",
              *(["--strategies", strategies] if strategies else [])]
    return {"1x8": [jaxscale, "compare", "--devices", str(DEVICES), *common,
                    "--out", str(tmp / "out-1x8")],
            "2x4": [jaxscale, "launch", "--processes", str(PROCESSES), "--devices-per-process",
                    str(PER_PROCESS), "--logs", str(tmp / "logs-2x4"), "--", "compare",
                    *common, "--out", str(tmp / "out-2x4")]}


def one_run(argv: list[str], env: dict) -> dict:
    """Run one compare command; its JSON result (compare exits 1 when a strategy misses
    the loss bound, and still prints it)."""
    t0 = time.perf_counter()
    try:
        r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        sys.exit(f"timed out after {LIMIT_S} s: {' '.join(argv)}")
    wall = time.perf_counter() - t0
    line = next((ln for ln in reversed(r.stdout.splitlines()) if ln.startswith("{")), None)
    if r.returncode not in (0, 1) or line is None:
        sys.exit(f"{' '.join(argv)} failed (exit code {r.returncode}):\n{r.stderr[-4000:]}")
    return {"rc": r.returncode, "wall_s": round(wall, 1), "result": json.loads(line)}


def strategy_figures(row: dict) -> dict:
    """What the benchmark keeps of one compare row."""
    if row["status"] != "ok":
        return {"status": row["status"], "error": row.get("error")}
    keep = ("plan", "mesh", "n_devices", "losses", "step_s", "step_s_q1", "step_s_q3",
            "compile_s", "compile_source", "max_rel_dloss", "pass", "sent",
            "sent_cross_process", "sent_cross_process_predicted")
    out = {"status": "ok", **{k: row[k] for k in keep if k in row}}
    out["sent_predicted"] = row["predicted"]["sent"] if row.get("predicted") else None
    return out


def rel_loss_diff(a: list[float], b: list[float]) -> float:
    """The largest |a - b| / |b| over the steps."""
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def _total(d: dict | None) -> float | None:
    return None if d is None else float(sum(d.values()))


def summarize(runs: list[dict]) -> dict:
    """Per strategy: step times and ratios over rounds, bytes split, worst loss difference."""
    rounds = sorted({r["round"] for r in runs})
    by = {(r["config"], r["round"]): r["strategies"] for r in runs}
    names = list(by["1x8", rounds[0]])
    out = {}
    for name in names:
        rows = {(c, k): by[c, k].get(name, {"status": "missing"}) for c in CONFIGS
                for k in rounds}
        if any(row["status"] != "ok" for row in rows.values()):
            out[name] = {"status": "failed",
                         "errors": {f"{c} round {k}": row.get("error") or row["status"]
                                    for (c, k), row in rows.items() if row["status"] != "ok"}}
            continue
        step = {c: [rows[c, k]["step_s"] for k in rounds] for c in CONFIGS}
        ratios = [rows["2x4", k]["step_s"] / rows["1x8", k]["step_s"] for k in rounds]
        two = rows["2x4", rounds[0]]
        n = two["n_devices"]
        sent, cross = _total(two["sent"]), _total(two.get("sent_cross_process"))
        pred, pred_cross = _total(two["sent_predicted"]), _total(
            two.get("sent_cross_process_predicted"))
        out[name] = {
            "status": "ok", "mesh": two["mesh"], "n_devices": n,
            "processes_spanned": len({i // PER_PROCESS for i in range(n)}),
            "step_s": {c: statistics.median(v) for c, v in step.items()},
            "step_s_by_round": step,
            "step_ratio_2x4_to_1x8": statistics.median(ratios),
            "step_ratio_by_round": ratios,
            "bytes_per_device_per_step": {
                "sent": sent, "within_process": None if cross is None else sent - cross,
                "cross_process": cross,
                "predicted_sent": pred,
                "predicted_within_process": (None if pred_cross is None else pred - pred_cross),
                "predicted_cross_process": pred_cross,
                "cross_process_by_op": two.get("sent_cross_process"),
                "predicted_cross_process_by_op": two.get("sent_cross_process_predicted"),
                "same_hlo_bytes_in_1x8": rows["1x8", rounds[0]]["sent"] == two["sent"]},
            "max_rel_loss_diff_2x4_vs_1x8": max(
                rel_loss_diff(rows["2x4", k]["losses"], rows["1x8", k]["losses"])
                for k in rounds),
            "losses_repeat_across_rounds": {
                c: all(rows[c, k]["losses"] == rows[c, rounds[0]]["losses"] for k in rounds)
                for c in CONFIGS},
            "max_rel_dloss_vs_single": {c: max(rows[c, k]["max_rel_dloss"] for k in rounds)
                                        for c in CONFIGS},
            "pass": {c: all(rows[c, k]["pass"] for k in rounds) for c in CONFIGS}}
    return out


def _b(x: float | None) -> str:
    if x is None:
        return "-"
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.4g}{unit}"
    return f"{x:.0f}"


def show(summary: dict) -> None:
    from jaxscale.report import print_table
    cols = ["strategy", "mesh", "procs", "1x8 step", "2x4 step", "2x4/1x8",
            "in-proc B meas/pred", "cross-proc B meas/pred", "max dloss 2x4 vs 1x8"]
    rows = []
    for name, s in summary.items():
        if s["status"] != "ok":
            rows.append([name, "-", "-", "FAILED", *["-"] * 5])
            continue
        b = s["bytes_per_device_per_step"]
        rows.append([name, s["mesh"], str(s["processes_spanned"]),
                     f"{s['step_s']['1x8'] * 1e3:.1f} ms", f"{s['step_s']['2x4'] * 1e3:.1f} ms",
                     f"{s['step_ratio_2x4_to_1x8']:.2f}",
                     f"{_b(b['within_process'])} / {_b(b['predicted_within_process'])}",
                     f"{_b(b['cross_process'])} / {_b(b['predicted_cross_process'])}",
                     f"{s['max_rel_loss_diff_2x4_vs_1x8']:.1e}"])
    print_table(f"{PROCESSES} processes x {PER_PROCESS} devices (gloo over localhost TCP) vs "
                f"1 process x {DEVICES} devices (in-process), tiny model", cols, rows)


def notes() -> list[str]:
    """How to read the figures (written into the result)."""
    return [
        "step_s: compare's median over the timed repeats; per configuration the median over "
        "rounds; step_ratio_2x4_to_1x8 the median over rounds of the per-round ratio (both "
        "configurations measured in the same round, back to back)",
        f"all {DEVICES} devices share this host's {os.cpu_count()} cores in both "
        "configurations: the ratio measures the cost of the second process and of gloo over "
        "TCP, not a speed-up",
        "strategies on at most 4 devices (single, control, tp, pp) run inside process 0 alone "
        "in the 2x4 job (process 1 idles): nothing crosses, yet their collectives run over "
        "gloo too (tp's all-reduces then differ from 1x8 by ulps: gloo sums in another order), "
        "and the ratio also shows a process with 4 forced devices against one with 8",
        "bytes: per device per step if every collective runs as a ring over its replica group "
        "(measure.ring_bytes_by_op); cross_process counts the ring hops (permute pairs) that "
        "join devices of two processes under the 2x4 placement (tp inside a process, then pp, "
        "dp across); predicted_*: compare.predict's bytes, split by axis, x the share of that "
        "axis's hops that cross",
        "max_rel_loss_diff_2x4_vs_1x8: the largest |loss_2x4 - loss_1x8| / loss_1x8 at any "
        "step, over the rounds; both runs train on the same batches from the same initial "
        "parameters; set it beside each run's loss_bound (compare's bound against the single "
        "device: 20 x the control's drift, at least 1e-6)"]


def versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("jax", "jaxlib", "flax", "optax", "jaxscale"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="round-robin rounds (default 2)")
    ap.add_argument("--steps", type=int, default=20, help="training steps (compare's default)")
    ap.add_argument("--repeats", type=int, default=15,
                    help="timed steps per strategy and run (compare's default)")
    ap.add_argument("--strategies", default=None,
                    help="compare's --strategies (default: its default set on 8 devices)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "multiprocess.json"))
    args = ap.parse_args()
    jaxscale = str(Path(sys.executable).parent / "jaxscale")
    runs, t_start = [], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="jaxscale-multiprocess-") as tmp_name:
        tmp = Path(tmp_name)
        env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC")}
        env["JAXSCALE_CACHE_DIR"] = str(tmp / "cache")
        cmds = commands(jaxscale, tmp, args.steps, args.repeats, args.strategies)
        order = [(k, c) for k in range(args.rounds)
                 for c in (CONFIGS if k % 2 == 0 else CONFIGS[::-1])]
        for i, (k, config) in enumerate(order):
            run = one_run(cmds[config], env)
            res = run.pop("result")
            run.update(config=config, round=k, all_pass=res.get("all_pass"),
                       loss_bound=res["noise"]["tolerance"],
                       processes=res.get("processes", 1),
                       strategies={r["name"]: strategy_figures(r) for r in res["rows"]})
            runs.append(run)
            left = (time.perf_counter() - t_start) / (i + 1) * (len(order) - i - 1)
            print(f"[{i + 1}/{len(order)}] round {k + 1} {config}: rc={run['rc']} "
                  f"{run['wall_s']:.0f} s (about {left / 60:.0f} min left)", file=sys.stderr,
                  flush=True)
        shown_cmds = {c: " ".join(a.replace(tmp_name, "$TMP") for a in argv).replace(
            jaxscale, "jaxscale") for c, argv in cmds.items()}
    summary = summarize(runs)
    ok = [s for s in summary.values() if s["status"] == "ok"]
    spanning = [s["step_ratio_2x4_to_1x8"] for s in ok if s["processes_spanned"] > 1]
    out = {"benchmark": "multiprocess", "cores": os.cpu_count(), "machine": platform.machine(),
           "versions": versions(), "model": "tiny", "devices": DEVICES,
           "configs": {"1x8": f"1 process x {DEVICES} devices",
                       "2x4": f"{PROCESSES} processes x {PER_PROCESS} devices"},
           "transport": TRANSPORT,
           "commands": shown_cmds, "cache": "one compilation cache in $TMP/cache for both "
                                            "configurations (round 1 compiles, later rounds load)",
           "strategies": args.strategies or "compare's default set",
           "rounds": args.rounds, "steps": args.steps, "repeats": args.repeats,
           "order": [f"round {k + 1}: {c}" for k, c in order],
           "wall_s": round(time.perf_counter() - t_start, 1),
           "notes": notes(),
           "median_step_ratio_spanning_both_processes": (statistics.median(spanning)
                                                         if spanning else None),
           "summary": summary, "runs": runs}
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    show(summary)
    print(f"{len(order)} runs in {out['wall_s'] / 60:.1f} min; wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
