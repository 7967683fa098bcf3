"""Benchmark: the FP8 policies and bf16 optimizer states against their targets (issue 37).

Two measurements, each through the command a user runs:

  strategies   `jaxscale compare --model tiny --precision P` for fp8, fp8-delayed and
               fp8-block: every default strategy against its own single-device run,
               within compare's measured bound (20 x the control's drift)
  training     `jaxscale train --model small` for 40 steps (lr 1e-3, warmup 5, batch 16)
               in bf16, fp8, fp8-delayed, fp8-block, and bf16 with bf16 moments: the
               validation loss against bf16's (targets: fp8 policies within 3%, bf16
               moments within 1%), and the wall time (CPU: FP8 is emulated, its time is
               no speed figure). Validation computes in fp32 with native products,
               whatever the policy: it measures the weights the policy trained

    python benchmarks/fp8.py [--parts strategies,training]

Writes benchmarks/results/fp8.json (each run replaces the parts it ran).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "fp8.json"
TRAIN = ["--model", "small", "--steps", "40", "--lr", "1e-3", "--warmup", "5",
         "--batch-size", "16", "--eval-every", "20"]
RUNS = {"bf16": ["--precision", "bf16"], "fp8": ["--precision", "fp8"],
        "fp8-delayed": ["--precision", "fp8-delayed"], "fp8-block": ["--precision", "fp8-block"],
        "bf16, bf16 moments": ["--precision", "bf16", "--optimizer-state-dtype", "bf16"]}
TARGETS = {"fp8": 0.03, "fp8-delayed": 0.03, "fp8-block": 0.03, "bf16, bf16 moments": 0.01}
POLICIES = ("fp8", "fp8-delayed", "fp8-block")


def jaxscale(*args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "jaxscale", *args, "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    if done.returncode not in (0, 1):
        raise RuntimeError(f"jaxscale {' '.join(args)} exited {done.returncode}: "
                           f"{done.stderr[-1500:]}")
    return json.loads(done.stdout)


def strategies() -> dict:
    out = {}
    for policy in POLICIES:
        with tempfile.TemporaryDirectory() as folder:
            r = jaxscale("compare", "--model", "tiny", "--precision", policy, "--steps", "5",
                         "--repeats", "3", "--out", folder)
        out[policy] = {"bound": r["noise"]["tolerance"], "control_drift": r["noise"]["drift"],
                       "all_pass": r["all_pass"],
                       "rows": {row["name"]: {"pass": row["pass"],
                                              "max_rel_dloss": row.get("max_rel_dloss")}
                                for row in r["rows"]}}
        print(policy, "all pass" if r["all_pass"] else "NOT all pass", flush=True)
    return out


def training() -> dict:
    rows = {}
    for name, extra in RUNS.items():
        with tempfile.TemporaryDirectory() as folder:
            start = time.perf_counter()
            r = jaxscale("train", *TRAIN, *extra, "--out", folder)
            rows[name] = {"val_loss": r["val_loss"], "wall_s": time.perf_counter() - start}
        print(name, rows[name], flush=True)
    ref = rows["bf16"]["val_loss"]
    for name, target in TARGETS.items():
        rows[name]["vs_bf16"] = rows[name]["val_loss"] / ref - 1
        rows[name]["target"] = target
        rows[name]["meets"] = abs(rows[name]["vs_bf16"]) <= target
    return {"settings": TRAIN, "rows": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="strategies,training")
    args = parser.parse_args(argv)
    result = json.loads(OUT.read_text()) if OUT.exists() else {"benchmark": "fp8"}
    parts = {"strategies": strategies, "training": training}
    for part in args.parts.split(","):
        if part not in parts:
            parser.error(f"unknown part {part!r}; choose from {', '.join(parts)}")
        result[part] = parts[part]()
    result["date"] = time.strftime("%Y-%m-%d")
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
