"""Benchmark: does the CPU runtime ever abort? The collective-heavy strategies, many times.

    python benchmarks/runtime_stability.py [--warm 30] [--cold 10] [--threads auto|N]

Each run is a fresh process that trains one strategy of `jaxscale compare`, or a layout
written out (`--layout dp=8,zero=3,micro_batches=2,remat=full`), on 8 forced CPU
devices (tiny model, 10 steps, then the timed repeats) through compare's own code path,
`compare.run_strategy`. Warm runs share one compilation cache (filled first), cold runs each
get an empty one. Runs are interleaved round-robin over the strategies so that every
strategy meets the same machine load. A run "aborts" when its process dies or hangs past the
time limit; the XLA rendezvous message, if any, is kept.

`--threads` sets PJRT_NPROC (the CPU runtime's pool size, see jaxscale/runtime/devices.py): `auto`
leaves it to `force_cpu_devices` (the fix), a number forces it, e.g. `--threads 8` for what
jaxlib chooses by itself for 8 devices on 2 cores (the state before the fix). Several
settings, comma-separated, run round-robin (the step-time ratios between them are measured
under the same load). Records aborts per setting and strategy, and median step times, in
benchmarks/results/runtime_stability[TAG].json.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from jaxscale.model import config as model_config

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = ("dp+tp", "3d", "zero3", "pp", "dp+pp")
DEVICES = 8
LIMIT_S = 150  # a warm run takes ~5-15 s, a cold one ~10-40 s; an abort waits 40 s first


def worker(name: str) -> None:
    """One run: train `name` as compare does and print its median step time as JSON."""
    from jaxscale.runtime.devices import force_cpu_devices
    devices = force_cpu_devices(DEVICES)
    from jaxscale import garden
    from jaxscale.model import optim
    from jaxscale.runtime.compile_cache import enable_compilation_cache
    from jaxscale.compare.strategies import run_strategy, strategy_plan
    from jaxscale.parallel.plan import Plan
    from jaxscale.training.config import TrainConfig
    from jaxscale.training.reference import as_arrays, init_run
    enable_compilation_cache()
    cfg = model_config.preset("tiny")
    _, params, _ = init_run(TrainConfig(model="tiny"))
    it = garden.make_corpus(0, seq_len=cfg.seq_len).train_batches(32, seed=1)
    from jaxscale.data.sampler import FixedBatches
    batches = FixedBatches([as_arrays(next(it)) for _ in range(10)])
    plan = Plan.parse(name) if "=" in name else strategy_plan(name, DEVICES, cfg)
    row = run_strategy(name, plan, cfg, params, batches, optim.adamw(3e-3), devices)
    print(json.dumps({"step_s": row["step_s"], "threads": os.environ.get("PJRT_NPROC")}))


def one_run(name: str, cache: str, threads: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC")}
    env["JAXSCALE_CACHE_DIR"] = cache
    if threads != "auto":
        env["PJRT_NPROC"] = threads
    t0 = time.perf_counter()
    try:
        r = subprocess.run([sys.executable, __file__, "--worker", name], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=LIMIT_S)
        rc, out, err = r.returncode, r.stdout, r.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = "timeout", "", (e.stderr or b"").decode(errors="replace")
    wall = time.perf_counter() - t0
    run = {"strategy": name, "rc": rc, "wall_s": round(wall, 2)}
    if rc == 0:
        run.update(json.loads(out.strip().splitlines()[-1]))
    else:
        why = [ln for ln in err.splitlines() if "Termination timeout" in ln or "Check failed" in ln]
        run["error"] = (why[0] if why else err.strip()[-300:])[:400]
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warm", type=int, default=30, help="warm-cache runs per strategy")
    ap.add_argument("--cold", type=int, default=10, help="cold-cache runs per strategy")
    ap.add_argument("--threads", default="auto",
                    help="PJRT_NPROC settings to compare, round-robin: auto (the fix) or numbers")
    ap.add_argument("--strategies", default=",".join(STRATEGIES),
                    help="compare's strategy names, comma-separated ('' for none)")
    ap.add_argument("--layout", action="append", default=[],
                    help="a layout written out (Plan.parse), repeatable")
    ap.add_argument("--tag", default="", help="suffix of the result file name")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker)
    names = [n for n in args.strategies.split(",") if n] + args.layout
    settings = args.threads.split(",")
    runs, t_start = [], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="jaxscale-stability-") as tmp:
        warm_cache = str(Path(tmp) / "warm")
        for name in names:  # fill the warm cache (these runs are not counted)
            one_run(name, warm_cache, settings[-1])
        plan = [("warm", n, t) for _ in range(args.warm) for n in names for t in settings]
        plan += [("cold", n, t) for _ in range(args.cold) for n in names for t in settings]
        for i, (kind, name, threads) in enumerate(plan):
            cache = warm_cache if kind == "warm" else str(Path(tmp) / f"cold{i}")
            run = {"cache": kind, "setting": threads, **one_run(name, cache, threads)}
            runs.append(run)
            left = (time.perf_counter() - t_start) / (i + 1) * (len(plan) - i - 1)
            print(f"[{i + 1}/{len(plan)}] {kind} {name} threads={threads}: rc={run['rc']} "
                  f"{run['wall_s']:.1f} s (about {left / 60:.0f} min left)", file=sys.stderr,
                  flush=True)
    summary = {}
    for threads in settings:
        summary[threads] = {}
        for name in names:
            mine = [r for r in runs if r["strategy"] == name and r["setting"] == threads]
            steps = [r["step_s"] for r in mine if r["rc"] == 0]
            summary[threads][name] = {
                kind: {"runs": sum(r["cache"] == kind for r in mine),
                       "aborts": sum(r["cache"] == kind and r["rc"] != 0 for r in mine)}
                for kind in ("warm", "cold")}
            summary[threads][name]["median_step_s"] = statistics.median(steps) if steps else None
        summary[threads]["aborts"] = sum(r["rc"] != 0 for r in runs if r["setting"] == threads)
    base = settings[0]  # step time of each setting as a ratio to the first, per strategy
    for threads in settings:
        ratios = [summary[threads][n]["median_step_s"] / summary[base][n]["median_step_s"]
                  for n in names if summary[threads][n]["median_step_s"]
                  and summary[base][n]["median_step_s"]]
        summary[threads][f"step_ratio_to_{base}"] = statistics.median(ratios) if ratios else None
    out = {"benchmark": "runtime_stability", "cores": os.cpu_count(), "devices": DEVICES,
           "settings": settings, "total_aborts": sum(r["rc"] != 0 for r in runs),
           "total_runs": len(runs), "wall_s": round(time.perf_counter() - t_start, 1),
           "summary": summary, "runs": runs}
    path = ROOT / "benchmarks" / "results" / f"runtime_stability{args.tag}.json"
    path.write_text(json.dumps(out, indent=1))
    print(json.dumps(summary, indent=1), f"\n{out['total_aborts']} aborts in "
          f"{out['total_runs']} runs; wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
