"""Benchmark: cold wall time of the README's test command on a fresh clone.

Clones the repository's HEAD into a temporary folder (so no compilation cache and no
virtual environment exist yet), runs `.ci/run` there and records the whole wall time
(virtual environment, install, pytest) and pytest's own reported time. Writes
benchmarks/results/test_suite.json. The budget is 15 minutes (900 s) on the slower 2-core kind
of machine.

    python benchmarks/suite_time.py
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main():
    with tempfile.TemporaryDirectory() as tmp:
        clone = Path(tmp) / "jaxscale"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=clone,
                                capture_output=True, text=True).stdout.strip()  # what ran
        t0 = time.perf_counter()
        r = subprocess.run(["bash", ".ci/run"], cwd=clone, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    tail = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    m = re.search(r"(\d+) passed.* in ([\d.]+)s", tail)
    if r.returncode != 0 or not m:
        sys.exit(f".ci/run failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    result = {"benchmark": "test_suite_cold", "ci_wall_s": wall, "pytest_s": float(m.group(2)),
              "tests_passed": int(m.group(1)), "target_s": 900, "cpus": os.cpu_count(),
              "reruns": int(r2.group(1)) if (r2 := re.search(r"(\d+) rerun", tail)) else 0,
              "commit": commit}
    out = ROOT / "benchmarks" / "results" / "test_suite.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"fresh clone: .ci/run {wall:.1f} s in all, pytest {result['pytest_s']:.1f} s, "
          f"{result['tests_passed']} passed (target < {result['target_s']} s)")


if __name__ == "__main__":
    main()
