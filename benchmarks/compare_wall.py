"""Benchmark: cold wall time of the main job, `jaxscale compare` with its defaults.

    python benchmarks/compare_wall.py [--repeats 3]

Runs the whole command in fresh processes with the persistent compilation cache off (a
first run on a new machine compiles every strategy): 8 forced CPU devices, the tiny model,
20 steps, every default strategy. Records each run's wall time, the median, the 120 s
target, and the last run's full result (the table, measured next to predicted) in
benchmarks/results/compare.json.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 120.0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    env = {**os.environ, "JAXSCALE_CACHE_DIR": "off"}
    walls, result = [], None
    for i in range(args.repeats):
        t0 = time.perf_counter()
        r = subprocess.run([str(ROOT / ".venv" / "bin" / "jaxscale"), "compare", "--json",
                            "--out", str(ROOT / "runs" / "bench_compare")], cwd=ROOT, env=env,
                           capture_output=True, text=True)
        walls.append(time.perf_counter() - t0)
        if r.returncode != 0:
            sys.exit(f"jaxscale compare failed:\n{r.stderr[-4000:]}")
        result = json.loads(r.stdout)
        print(f"cold run {i + 1}/{args.repeats}: {walls[-1]:.1f} s", file=sys.stderr)
    out = {"command": "jaxscale compare", "cores": os.cpu_count(), "walls_s": walls,
           "median_s": statistics.median(walls), "target_s": TARGET_S,
           "within_target": statistics.median(walls) <= TARGET_S, "result": result}
    path = ROOT / "benchmarks" / "results" / "compare.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"median {out['median_s']:.1f} s (target {TARGET_S:.0f} s); wrote {path}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
