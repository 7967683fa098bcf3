"""Benchmark: wall time of an experiment module, cold (no compilation cache) and warm.

    python benchmarks/experiment_wall.py optimizers [--repeats 3]

Runs `python -m experiments.<name> --json` in fresh processes: `--repeats` times with the
persistent compilation cache off (a first run on a new machine), then once to fill a
private cache and `--repeats` times with it warm (every later run). Records the medians,
each run's per-part timings, and the module's target (60 s; model_parallel 90 s) in
benchmarks/results/experiment_<name>.json.
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

ROOT = Path(__file__).resolve().parents[1]
TARGETS_S = {"model_parallel": 90.0}  # the issues' targets; 60 s for the others


def run(name: str, cache: str) -> dict:
    env = {**os.environ, "JAXSCALE_CACHE_DIR": cache}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", f"experiments.{name}", "--json", "--out",
                        str(ROOT / "runs" / f"bench_{name}")], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"experiments.{name} failed:\n{r.stderr[-4000:]}")
    return {"wall_s": wall, "parts_s": json.loads(r.stdout)["timings_s"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", help="experiment module, e.g. optimizers")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cold = []
    for i in range(args.repeats):
        cold.append(run(args.name, "off"))
        print(f"cold {i + 1}/{args.repeats}: {cold[-1]['wall_s']:.1f} s", file=sys.stderr)
    with tempfile.TemporaryDirectory() as cache:
        run(args.name, cache)  # fill the cache
        warm = []
        for i in range(args.repeats):
            warm.append(run(args.name, cache))
            print(f"warm {i + 1}/{args.repeats}: {warm[-1]['wall_s']:.1f} s", file=sys.stderr)
    med = lambda runs: statistics.median(r["wall_s"] for r in runs)  # noqa: E731
    target = TARGETS_S.get(args.name, 60.0)
    result = {"benchmark": f"experiment_{args.name}", "target_wall_s": target,
              "median_cold_s": med(cold), "median_warm_s": med(warm),
              "meets_target_cold": med(cold) <= target, "cold": cold, "warm": warm,
              "cpus": os.cpu_count()}
    out = ROOT / "benchmarks" / "results" / f"experiment_{args.name}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"experiments.{args.name}: median {med(cold):.1f} s cold, {med(warm):.1f} s warm "
          f"(target <= {target:.0f} s); written to {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
