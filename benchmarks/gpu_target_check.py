"""Benchmark: is a GPU target compiled from a CPU machine the GPU itself? Run it on the GPU.

`jaxscale compare --abstract --target h100-1` compiles for an NVIDIA GPU from any machine:
the CUDA plugin's compile-only device, told the chip's facts by
jaxscale.runtime.gpu_target_config. This script, run on a machine with that GPU, compiles
the same training steps twice, in two processes with the same jax and XLA:

  target    compare --abstract --target h100-1 (or h200-1): the compile-only device
  real      compare --abstract --platform gpu --devices 1: the GPU in the machine

and records XLA's memory figures (arguments, outputs, temporaries, peak) of each layout
from both, and their relative differences. Equal figures say the target stands for the
chip; where they differ, the rows show by how much (the reference is the real GPU's).

    python benchmarks/gpu_target_check.py [--model small] [--out FILE]

Writes FILE (default benchmarks/results/gpu_target_check.json); exit 1 if either side
fails to compile, 0 otherwise (a difference is a finding, not a failure).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = ("dp=1", "remat=full", "precision=bf16", "precision=bf16,remat=selective")
FIELDS = ("arguments", "outputs", "temporaries", "peak")


def compile_rows(model: str, where: list[str]) -> tuple[dict, float]:
    """compare --abstract's rows by strategy name, and the seconds it took."""
    cmd = [sys.executable, "-m", "jaxscale", "compare", "--abstract", "--model", model,
           "--devices", "1", "--out", str(ROOT / "runs" / "gpu_target_check" / where[-1]),
           "--json", *where]
    for s in STRATEGIES:
        cmd += ["--strategy", s]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=140)
    took = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr[-1500:]}")
    return {r["name"]: r for r in json.loads(done.stdout)["rows"]}, took


def gpu_kind() -> str:
    """h100 or h200, from the device the machine's jax sees."""
    probe = "import jax; print(jax.devices()[0].device_kind)"
    kind = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120).stdout.strip()
    for name in ("h100", "h200"):
        if name in kind.lower():
            return name
    raise SystemExit(f"gpu_target_check: the device is {kind!r}; targets exist for an "
                     "H100 or H200 only")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" /
                                              "gpu_target_check.json"))
    args = parser.parse_args(argv)
    kind = gpu_kind()
    target, t_target = compile_rows(args.model, ["--target", f"{kind}-1"])
    real, t_real = compile_rows(args.model, ["--platform", "gpu"])
    rows = []
    for name in STRATEGIES:
        a, b = target[name]["memory"], real[name]["memory"]
        if a is None or b is None:  # refused by one compiler: its own words stand
            rows.append({"strategy": name, "target": a, "real": b, "rel_diff": None,
                         "refused": target[name].get("refused") or real[name].get("refused")})
            continue
        rows.append({"strategy": name, "target": a, "real": b, "rel_diff": {
            f: (a[f] - b[f]) / b[f] if b[f] else float(a[f] != b[f]) for f in FIELDS}})
    result = {"benchmark": "gpu_target_check", "date": time.strftime("%Y-%m-%d"),
              "gpu": kind, "model": args.model, "seconds": {"target": round(t_target, 1),
                                                            "real": round(t_real, 1)},
              "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for r in rows:
        if r["rel_diff"] is None:
            print(r["strategy"], "refused:", r["refused"])
            continue
        print(r["strategy"], " ".join(f"{f} {r['target'][f]:,}/{r['real'][f]:,} "
                                      f"({r['rel_diff'][f]:+.2%})" for f in FIELDS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
