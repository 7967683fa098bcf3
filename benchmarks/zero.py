"""Benchmark: ZeRO stages' step time as a ratio to plain DP, and remat's overhead.

    python benchmarks/zero.py [--repeats 5]

On 8 forced CPU devices (ZeRO over dp=4 and dp=8, tiny model, AdamW, batch 32): the
compiled steps of DP and ZeRO 1, 2, 3 are timed round-robin (each round times every
strategy once, `--steps` calls each), and the ratio to DP is the median over rounds.
Remat: the single-device step with remat none / matmuls / full, the same way, with XLA's
FLOP count beside each (the +1/3 of per-block recomputation shows there, not necessarily in
a memory-bound CPU's time). Writes benchmarks/results/zero.json.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxscale.runtime.devices import force_cpu_devices  # noqa: E402

force_cpu_devices(8)

import jax  # noqa: E402

from jaxscale import garden  # noqa: E402
from jaxscale.model import transformer as M, optim  # noqa: E402
from jaxscale.runtime.compile_cache import enable_compilation_cache  # noqa: E402
from jaxscale.parallel.plan import Plan  # noqa: E402
from jaxscale.parallel.build import build_train_step  # noqa: E402
from jaxscale.training.config import TrainConfig  # noqa: E402
from jaxscale.training.reference import as_arrays, init_run  # noqa: E402
from jaxscale.model import config as model_config


def prepared(cfg, params, batch, plan):
    init, step = build_train_step(cfg, plan, optim.adamw(3e-3), jax.devices()[:plan.n_devices])
    state = init(params)
    placed = step.place_batch(batch)
    compiled = step.jitted.lower(state, placed).compile()
    jax.block_until_ready(compiled(state, placed))
    return compiled, state, placed


def round_robin(programs: dict, rounds: int, steps: int) -> dict:
    times = {k: [] for k in programs}
    for _ in range(rounds):
        for name, (compiled, state, batch) in programs.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                out = compiled(state, batch)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - t0) / steps)
    return times


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7, help="rounds (default 7)")
    ap.add_argument("--steps", type=int, default=10, help="calls per timing (default 10)")
    args = ap.parse_args()
    enable_compilation_cache()
    cfg = model_config.preset("tiny")
    _, params, _ = init_run(TrainConfig())
    batch = as_arrays(next(garden.make_corpus(0).train_batches(32)))
    result = {"device_count": 8, "batch": 32, "rounds": args.repeats, "steps": args.steps}
    for k in (4, 8):
        programs = {f"zero{s}": prepared(cfg, params, batch, Plan(dp=k, zero_stage=s))
                    for s in range(4)}
        times = round_robin(programs, args.repeats, args.steps)
        result[f"dp{k}"] = {
            name: {"median_ms": statistics.median(t) * 1e3,
                   "ratio_to_dp": statistics.median(a / b for a, b in zip(t, times["zero0"]))}
            for name, t in times.items()}
        print(f"dp={k}: " + ", ".join(f"{n} {v['ratio_to_dp']:.2f}x"
                                      for n, v in result[f"dp{k}"].items()), file=sys.stderr)
    batch128 = as_arrays(next(garden.make_corpus(0).train_batches(128)))
    programs = {r: prepared(cfg, params, batch128, Plan(remat=r)) for r in M.REMAT_POLICIES}
    times = round_robin(programs, args.repeats, args.steps)
    result["remat"] = {
        r: {"median_ms": statistics.median(t) * 1e3,
            "ratio_to_none": statistics.median(a / b for a, b in zip(t, times["none"])),
            "flops_ratio_to_none": programs[r][0].cost_analysis()["flops"]
            / programs["none"][0].cost_analysis()["flops"]}
        for r, t in times.items()}
    print("remat: " + ", ".join(f"{r} time {v['ratio_to_none']:.2f}x flops "
                                f"{v['flops_ratio_to_none']:.2f}x"
                                for r, v in result["remat"].items()), file=sys.stderr)
    out = ROOT / "benchmarks" / "results" / "zero.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
