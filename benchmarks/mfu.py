"""Benchmark: tokens/s and MFU of one CPU device's training step; and `collect`, which turns
the steps of benchmarks/gpu_check.sh into one JSON.

    python benchmarks/mfu.py [--repeats 5] [--steps 10] [--warmup 2] [--out PATH] [--quick]
    python benchmarks/mfu.py collect --work DIR --out FILE [--platform gpu] [--budget S]

The CPU benchmark (the default command): models tiny and small on ONE CPU device (fp32,
the layers scanned, einsum attention) at batch 8 and 32, and for small at batch 32 the same
step with the layers unrolled (`--unroll`) and with XLA's attention (`--attention xla`).
Each of the `--repeats` repeats is a full bench run in this process: a matmul peak measured
first (`jaxscale.measure.hardware.measure_matmul_peak`), then every configuration through
`jaxscale.bench.run` (compile, `--warmup` steps, the median of `--steps` timed steps), the
order rotated from repeat to repeat so that load on a shared machine hits all alike. MFU is
model FLOPs per token (jaxscale.model.flops, non-causal attention) x tokens/s over that repeat's
matmul peak; a CPU has no datasheet figure. Reported per configuration: the medians over
repeats of step ms, tokens/s and MFU; and the two comparisons as the median over repeats
of the ratio within one repeat (unrolled / scanned, xla / einsum step time).
tokens/s counts every position of a row: a tiny or small garden row is one document, about
a third of its 64 positions, the rest padding (jaxscale.bench's convention).
From the second repeat on, a compile is a load from the persistent compilation cache
(compile_s_first is the first repeat's: cold, or a cache hit from an earlier run).

Writes benchmarks/results/mfu_cpu.json. `--quick` (a smoke run for the tests: tiny only,
one repeat, 2 steps) writes to the system's temporary folder instead, unless --out is given.

`collect` reads a gpu_check.sh work folder (steps.tsv: one line per step, NAME KIND STATUS
RC START END TIMEOUT COMMAND; NAME.out: the step's stdout) and writes one JSON object: the
date, machine, versions (package metadata: nothing imports JAX), every step's status, rc and
seconds, every bench row, the profile's top ops, the compare and train results; and prints a
table of the bench rows (tokens/s, MFU against the datasheet and the measured matmul peak).
Its exit status is 0 whatever the steps did (gpu_check.sh counts their failures itself).
"""
import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = ROOT / "benchmarks" / "results" / "mfu_cpu.json"
QUICK_OUT = Path(tempfile.gettempdir()) / "jaxscale-bench" / "mfu_cpu_quick.json"
# (label, BenchConfig fields): the recorded CPU set, and the quick one with the same shape
FULL = (("tiny b8", dict(model="tiny", batch_size=8)),
        ("tiny b32", dict(model="tiny", batch_size=32)),
        ("small b8", dict(model="small", batch_size=8)),
        ("small b32", dict(model="small", batch_size=32)),
        ("small b32 unroll", dict(model="small", batch_size=32, unroll=True)),
        ("small b32 xla", dict(model="small", batch_size=32, attention="xla")))
QUICK = (("tiny b4", dict(model="tiny", batch_size=4)),
         ("tiny b4 unroll", dict(model="tiny", batch_size=4, unroll=True)),
         ("tiny b4 xla", dict(model="tiny", batch_size=4, attention="xla")))
# ratios within each repeat: (name, numerator, denominator) by label
COMPARISONS = {"full": (("unroll / scan, small b32", "small b32 unroll", "small b32"),
                        ("xla / einsum attention, small b32", "small b32 xla", "small b32")),
               "quick": (("unroll / scan, tiny b4", "tiny b4 unroll", "tiny b4"),
                         ("xla / einsum attention, tiny b4", "tiny b4 xla", "tiny b4"))}
PACKAGES = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin",
            "jax-cuda13-pjrt", "nvidia-cudnn-cu12", "flax", "optax", "orbax-checkpoint",
            "numpy", "ml_dtypes", "rich", "matplotlib", "pytest", "hypothesis", "datasketch",
            "jaxscale")
FAILED = ("failed", "timeout")  # step statuses that make the check fail


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def versions() -> dict:
    """Installed versions from package metadata (None: not installed)."""
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def machine() -> dict:
    return {"cpus": os.cpu_count(), "machine": platform.machine(),
            "platform": platform.platform(), "loadavg": list(os.getloadavg())}


# --------------------------------------------------------------------------------------
# The CPU benchmark
# --------------------------------------------------------------------------------------

def repeat_once(configs, device, order) -> dict:
    """One full bench run: a matmul peak, then every configuration (in `order`)."""
    from jaxscale import bench
    from jaxscale.measure import hardware

    peak = hardware.measure_matmul_peak(device)
    rows = {}
    for label in order:
        r = bench.run(configs[label], device, peak)
        rows[label] = {"step_s": r.step_s, "tokens_per_s": r.tokens_per_s,
                       "mfu_matmul": r.mfu_matmul,
                       "mfu_causal_matmul": r.flops.total_causal * r.tokens_per_s
                       / peak.flops_per_s,
                       "achieved_flops_per_s": r.achieved_flops_per_s,
                       "compile_s": r.compile_s, "xla_flops_per_token": r.xla_flops_per_token,
                       "flops": r.flops.as_dict(), "step_s_all": r.step_s_all}
        log(f"    {label}: {r.step_s * 1e3:.2f} ms, {r.tokens_per_s:,.0f} tokens/s, MFU "
            f"{r.mfu_matmul:.1%} of {peak.flops_per_s / 1e9:.0f} GFLOP/s")
    return {"matmul_peak": peak.as_dict(), "rows": rows}


def summarise(label, cfg, runs) -> dict:
    per = [run["rows"][label] for run in runs]
    med = lambda key: statistics.median(p[key] for p in per)  # noqa: E731
    return {"config": cfg, "step_ms": med("step_s") * 1e3, "tokens_per_s": med("tokens_per_s"),
            "mfu_matmul": med("mfu_matmul"), "mfu_causal_matmul": med("mfu_causal_matmul"),
            "achieved_gflops_per_s": med("achieved_flops_per_s") / 1e9,
            "compile_s_first": per[0]["compile_s"],
            "analytic_flops_per_token": per[0]["flops"]["total"],
            "xla_flops_per_token": per[0]["xla_flops_per_token"],
            "step_ms_repeats": [p["step_s"] * 1e3 for p in per],
            "mfu_matmul_repeats": [p["mfu_matmul"] for p in per]}


def cpu_benchmark(args) -> dict:
    from jaxscale import bench
    from jaxscale.runtime import devices
    from jaxscale.training.checkpoint.meta import versions as jaxscale_versions
    from jaxscale.runtime.compile_cache import enable_compilation_cache

    device = devices.pick_devices("cpu", 1)[0]  # one CPU device, before JAX starts
    enable_compilation_cache()
    kind = "quick" if args.quick else "full"
    table = QUICK if args.quick else FULL
    configs = {label: bench.BenchConfig(precision="fp32", steps=args.steps,
                                        warmup=args.warmup, **kw) for label, kw in table}
    for c in configs.values():
        c.validate()
    labels = list(configs)
    t_start = time.perf_counter()
    runs = []
    for i in range(args.repeats):
        order = labels[i % len(labels):] + labels[:i % len(labels)]
        log(f"repeat {i + 1}/{args.repeats}")
        runs.append(repeat_once(configs, device, order))
    peaks = [run["matmul_peak"]["flops_per_s"] for run in runs]
    comparisons = {}
    for name, num, den in COMPARISONS[kind]:
        ratios = [run["rows"][num]["step_s"] / run["rows"][den]["step_s"] for run in runs]
        comparisons[name] = {"step_time_ratio": statistics.median(ratios),
                             "repeats": ratios, "numerator": num, "denominator": den}
    return {
        "benchmark": "mfu_cpu", "quick": args.quick, "date": time.strftime("%Y-%m-%d"),
        "device": {"device_kind": device.device_kind, "platform": device.platform,
                   "devices": 1},
        "repeats": args.repeats, "steps": args.steps, "warmup": args.warmup,
        "definitions": {
            "step_ms": "median over repeats of bench.run's step time (the median of --steps "
                       "timed steps after compile and --warmup)",
            "tokens_per_s": "batch x seq_len / step time (padding included)",
            "mfu_matmul": "model FLOPs/token (non-causal attention) x tokens/s / the matmul "
                          "peak measured at the start of the same repeat",
            "mfu_causal_matmul": "the same with causal attention FLOPs (half the scores)",
            "step_time_ratio": "median over repeats of the ratio of step times within one "
                               "repeat"},
        "matmul_peak_gflops_per_s": {"median": statistics.median(peaks) / 1e9,
                                     "repeats": [p / 1e9 for p in peaks],
                                     "n": runs[0]["matmul_peak"]["n"],
                                     "dtype": runs[0]["matmul_peak"]["dtype"]},
        "configs": {label: summarise(label, asdict(configs[label]), runs)
                    for label in labels},
        "comparisons": comparisons,
        "machine": machine(), "versions": {**versions(), **jaxscale_versions()},
        "wall_s": round(time.perf_counter() - t_start, 1), "runs": runs}


def print_cpu_table(result) -> None:
    peak = result["matmul_peak_gflops_per_s"]
    print(f"matmul peak {peak['median']:.1f} GFLOP/s ({peak['dtype']}, n={peak['n']}; "
          f"median of {result['repeats']} repeats)")
    head = f"{'config':<18} {'step ms':>9} {'tokens/s':>11} {'GFLOP/s':>8} {'MFU matmul':>10}"
    print(head)
    print("-" * len(head))
    for label, c in result["configs"].items():
        print(f"{label:<18} {c['step_ms']:>9.2f} {c['tokens_per_s']:>11,.0f} "
              f"{c['achieved_gflops_per_s']:>8.2f} {c['mfu_matmul']:>10.1%}")
    for name, c in result["comparisons"].items():
        print(f"{name}: step time ratio {c['step_time_ratio']:.3f}")


def cpu_main(argv) -> int:
    ap = argparse.ArgumentParser(
        prog="mfu.py", description="tokens/s and MFU of one CPU device's training step "
        "(tiny, small; fp32), median over repeats; `mfu.py collect --help` for gpu_check.sh's "
        "collector")
    ap.add_argument("--repeats", type=int, default=None,
                    help="full bench runs, the median kept (default 5; --quick 1)")
    ap.add_argument("--steps", type=int, default=None,
                    help="timed steps per configuration (default 10; --quick 2)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed steps after the compile (default 2; --quick 1)")
    ap.add_argument("--quick", action="store_true",
                    help=f"smoke run: tiny only, written to {QUICK_OUT} unless --out")
    ap.add_argument("--out", default=None, help=f"JSON file (default {OUT})")
    ap.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    args = ap.parse_args(argv)
    for name, full, quick in (("repeats", 5, 1), ("steps", 10, 2), ("warmup", 2, 1)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.repeats < 1 or args.steps < 1 or args.warmup < 0:
        ap.error("--repeats and --steps must be >= 1, --warmup >= 0")
    result = cpu_benchmark(args)
    out = Path(args.out) if args.out else (QUICK_OUT if args.quick else OUT)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(json.dumps(result))
    else:
        print_cpu_table(result)
    log(f"wrote {out} in {result['wall_s']:.0f} s")
    return 0


# --------------------------------------------------------------------------------------
# collect: gpu_check.sh's steps -> one JSON
# --------------------------------------------------------------------------------------

def read_steps(work: Path) -> list[dict]:
    """steps.tsv: NAME KIND STATUS RC START END TIMEOUT COMMAND, tab-separated."""
    steps = []
    path = work / "steps.tsv"
    lines = path.read_text().splitlines() if path.exists() else []
    for line in lines:
        if not line.strip():
            continue
        name, kind, status, rc, start, end, limit, command = (line.split("\t", 7) + [""] * 8)[:8]
        num = lambda s: float(s.replace(",", ".")) if s else None  # noqa: E731 (locale)
        t0, t1 = num(start), num(end)
        steps.append({"name": name, "kind": kind, "status": status,
                      "rc": int(rc) if rc else None,
                      "seconds": None if t0 is None or t1 is None else round(t1 - t0, 2),
                      "timeout_s": int(limit) if limit else None, "command": command})
    return steps


def last_json(text: str):
    """The JSON object a command printed: the whole text, else its last line that is one."""
    try:
        out = json.loads(text)
        return out if isinstance(out, dict) else None
    except ValueError:
        pass
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def read_text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def label(config: dict) -> str:
    return (f"{config['model']} b{config['batch_size']} {config['precision']} "
            f"{config['remat']} {'unroll' if config.get('unroll') else 'scan'} "
            f"{config['attention']}")


def bench_row(step: str, result: dict, row: dict) -> dict:
    """One bench row, its headline figures first and the whole row under `row`."""
    c = row["config"]
    m = row.get("memory")  # XLA's analysis of the row's own program (bytes per device)
    mem = None if not m else m["arguments"] + m["outputs"] + m["temporaries"] - m["aliased"]
    return {"step": step, "label": label(c), "model": c["model"],
            "batch_size": c["batch_size"], "precision": c["precision"], "remat": c["remat"],
            "attention": c["attention"], "unroll": c.get("unroll", False),
            "compile_s": row["compile_s"], "step_ms": row["step_s"] * 1e3,
            "tokens_per_s": row["tokens_per_s"],
            "achieved_tflops_per_s": row["achieved_flops_per_s"] / 1e12,
            "mfu_datasheet": row.get("mfu_datasheet"), "mfu_matmul": row.get("mfu_matmul"),
            "mfu_causal_datasheet": row.get("mfu_causal_datasheet"),
            "analytic_flops_per_token": row["flops"]["total"],
            "xla_flops_per_token": row.get("xla_flops_per_token"),
            "step_memory_gib": None if mem is None else mem / 2 ** 30,
            "allocator_peak_gib": (None if row.get("allocator_peak_bytes") is None
                                   else row["allocator_peak_bytes"] / 2 ** 30),
            "matmul_peak_tflops_per_s": result["matmul_peak"]["flops_per_s"] / 1e12,
            "top_ops": row.get("extra", {}).get("top_ops"), "row": row}


def train_summary(result: dict) -> dict:
    losses = [x for x in result.get("loss_curve") or [] if x is not None]
    k = max(1, min(10, len(losses) // 4)) if losses else 0
    val = result.get("val_curve") or []
    first, last = (statistics.mean(losses[:k]), statistics.mean(losses[-k:])) if k else (None,
                                                                                         None)
    return {"model": result["config"]["model"], "steps_run": result.get("steps_run"),
            "batch_size": result["config"].get("batch_size"),
            "precision": result["config"].get("precision"),
            "attention": result["config"].get("attention"),
            "entropy_floor": result.get("entropy_floor"),
            "train_loss_first": first, "train_loss_last": last, "mean_of": k,
            "val_curve": val, "val_loss": result.get("val_loss"), "gap": result.get("gap"),
            "loss_fell": bool(k and last < first and (len(val) < 2 or val[-1][1] < val[0][1])),
            "reached_gap_at_s": result.get("reached_gap_at_s"),
            "compile_s": result.get("compile_s"), "train_s": result.get("train_s"),
            "tokens_per_s": result.get("tokens_per_s"),
            "nonfinite_step": result.get("nonfinite_step")}


def compare_summary(result: dict) -> dict:
    return {"model": result.get("model"), "devices": result.get("devices"),
            "steps": result.get("steps"), "all_pass": result.get("all_pass"),
            "rows": [{k: r.get(k) for k in ("name", "status", "pass", "max_rel_dloss",
                                           "compile_s", "step_s", "step_ratio")}
                     for r in result.get("rows", [])]}


def collect(work: Path, platform_name: str, budget: float | None, log_path: str | None,
            started: float | None = None) -> dict:
    steps = read_steps(work)
    out = lambda name: read_text(work / f"{name}.out")  # noqa: E731
    rows, peaks, compare, train, tests, profile = [], {}, None, None, None, None
    device_kind = bench_platform = datasheet = None
    for s in steps:
        if s["status"] in ("skipped", "not-needed"):
            continue
        data = last_json(out(s["name"])) if s["kind"] in ("bench", "profile", "train",
                                                          "compare") else None
        if s["kind"] in ("bench", "profile") and data and data.get("rows"):
            new = [bench_row(s["name"], data, r) for r in data["rows"]]
            peaks[s["name"]] = data["matmul_peak"]
            device_kind, bench_platform = data["device_kind"], data["platform"]
            datasheet = datasheet or data.get("datasheet_peak")
            if s["kind"] == "profile":
                profile = {"step": s["name"], "rows": new}
            else:
                rows.extend(new)
        elif s["kind"] == "train" and data:
            train = {"step": s["name"], "summary": train_summary(data), "result": data}
        elif s["kind"] == "compare" and data:
            compare = {"step": s["name"], "summary": compare_summary(data), "result": data}
        elif s["kind"] == "tests":
            text = out(s["name"]).strip().splitlines()
            summary = text[-1] if text else ""
            tests = {"step": s["name"], "rc": s["rc"], "status": s["status"],
                     "summary": summary,  # pytest's last line, e.g. "3 passed in 41.2s"
                     "none_ran": "passed" not in summary and "failed" not in summary}
    failed = [s["name"] for s in steps if s["status"] in FAILED]
    skipped = [s["name"] for s in steps if s["status"] == "skipped"]
    mm = [p["flops_per_s"] for p in peaks.values()]
    keep = ("XLA_FLAGS", "JAXSCALE_CACHE_DIR", "JAX_PLATFORMS", "XLA_PYTHON_CLIENT_MEM_FRACTION",
            "XLA_PYTHON_CLIENT_PREALLOCATE", "CUDA_VISIBLE_DEVICES", "PJRT_NPROC")
    return {
        "benchmark": "gpu_check", "dry_run": platform_name == "cpu",
        "platform_requested": platform_name, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": {"device_kind": device_kind, "platform": bench_platform,
                   "jax_devices": out("devices").strip() or None,
                   ("nvidia_smi" if platform_name == "gpu" else "uname"):
                   out("machine").strip() or None},
        "datasheet_peak_flops_per_s": datasheet,
        "matmul_peak_flops_per_s": {"median": statistics.median(mm) if mm else None,
                                    "min": min(mm, default=None), "max": max(mm, default=None),
                                    "per_step": {k: p["flops_per_s"] for k, p in peaks.items()},
                                    "n": next(iter(peaks.values()))["n"] if peaks else None,
                                    "dtype": next(iter(peaks.values()))["dtype"] if peaks
                                    else None},
        "budget_s": budget,
        "wall_s": None if started is None else round(time.time() - started, 1),
        "complete": not failed and not skipped, "failed": failed, "skipped": skipped,
        "steps": steps, "bench_rows": rows, "profile": profile, "tests": tests,
        "train": train, "compare": compare, "machine": machine(), "versions": versions(),
        "environment": {k: os.environ.get(k) for k in keep},
        "log": log_path, "work": str(work)}


def pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def print_summary(result: dict) -> None:
    steps = result["steps"]
    print(f"{'step':<28} {'status':<10} {'rc':>4} {'seconds':>8}")
    for s in steps:
        print(f"{s['name']:<28} {s['status']:<10} {'' if s['rc'] is None else s['rc']:>4} "
              f"{'' if s['seconds'] is None else format(s['seconds'], '.1f'):>8}")
    dk = result["device"]["device_kind"] or "?"
    ds = result["datasheet_peak_flops_per_s"]
    mm = result["matmul_peak_flops_per_s"]
    print(f"\n{dk}: datasheet {'-' if ds is None else format(ds / 1e12, '.4g')} TFLOP/s, "
          f"matmul measured {'-' if mm['median'] is None else format(mm['median'] / 1e12, '.4g')}"
          f" TFLOP/s ({mm['dtype']}, n={mm['n']}; median of the bench steps)")
    head = (f"{'config':<40} {'step ms':>9} {'tokens/s':>11} {'MFU datasheet':>13} "
            f"{'MFU matmul':>10} {'step GiB':>8} {'compile s':>9}")
    print(head)
    print("-" * len(head))
    for r in result["bench_rows"] + (result["profile"] or {}).get("rows", []):
        mem = "-" if r["step_memory_gib"] is None else f"{r['step_memory_gib']:.1f}"
        print(f"{r['label']:<40} {r['step_ms']:>9.2f} {r['tokens_per_s']:>11,.0f} "
              f"{pct(r['mfu_datasheet']):>13} {pct(r['mfu_matmul']):>10} {mem:>8} "
              f"{r['compile_s']:>9.1f}")
    if result["train"]:
        t = result["train"]["summary"]
        f = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
        print(f"\ntrain {t['model']}: {t['steps_run']} steps, loss {f(t['train_loss_first'])} "
              f"-> {f(t['train_loss_last'])}, validation {f(t['val_loss'])}, entropy floor "
              f"{f(t['entropy_floor'])} (gap {f(t['gap'])}); fell: {t['loss_fell']}")
    if result["compare"]:
        c = result["compare"]["summary"]
        print(f"compare {c['model']} on {c['devices']} device(s): all pass {c['all_pass']}; "
              + ", ".join(f"{r['name']} {r['status']}" for r in c["rows"]))
    if result["tests"]:
        t = result["tests"]
        print(f"tests: {t['status']} ({t['summary']})"
              + ("; none of them ran" if t["none_ran"] else ""))
    print(f"\nfailed: {', '.join(result['failed']) or 'none'}; skipped (budget): "
          f"{', '.join(result['skipped']) or 'none'}")


def collect_main(argv) -> int:
    ap = argparse.ArgumentParser(prog="mfu.py collect",
                                 description="assemble gpu_check.sh's steps into one JSON")
    ap.add_argument("--work", required=True, help="gpu_check.sh's work folder (steps.tsv)")
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--platform", default="gpu", choices=("gpu", "cpu"))
    ap.add_argument("--budget", type=float, default=None, help="the run's budget, seconds")
    ap.add_argument("--started", type=float, default=None, help="the run's start (epoch s)")
    ap.add_argument("--log", default=None, help="the run's log file (recorded)")
    args = ap.parse_args(argv)
    result = collect(Path(args.work), args.platform, args.budget, args.log, args.started)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print_summary(result)
    print(f"wrote {out}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["collect"]:
        return collect_main(argv[1:])
    return cpu_main(argv)


if __name__ == "__main__":
    sys.exit(main())
