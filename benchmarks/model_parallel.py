"""Benchmark: tensor, pipeline and 3-D steps as ratios to the single-device step.

    python benchmarks/model_parallel.py [--repeats 7]

On 8 forced CPU devices, tiny8 (8 layers, 8 heads), batch 32: the compiled steps of one
device, tp=2, pp=2 with 8 micro-batches under each schedule, and dp=2,tp=2,pp=2 (1F1B,
4 micro-batches) are timed round-robin (each round times every plan once, `--steps`
calls each); ratios are medians over rounds. Beside each pipeline: the idle share of its
lockstep tick table (unit costs) and the formula (p-1)/(v*m+p-1). Writes
benchmarks/results/model_parallel.json.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxscale.runtime.devices import force_cpu_devices  # noqa: E402

force_cpu_devices(8)

import numpy as np  # noqa: E402

from benchmarks.zero import prepared, round_robin  # noqa: E402
from jaxscale import garden  # noqa: E402
from jaxscale.runtime.compile_cache import enable_compilation_cache  # noqa: E402
from jaxscale.parallel import schedules as sched  # noqa: E402
from jaxscale.parallel.tick_table import IDLE, tick_table  # noqa: E402
from jaxscale.parallel.plan import Plan  # noqa: E402
from jaxscale.training.config import TrainConfig  # noqa: E402
from jaxscale.training.reference import as_arrays, init_run  # noqa: E402
from jaxscale.model import config as model_config

PLANS = {"single": Plan(), "tp2": Plan(tp=2),
         "pp2_gpipe": Plan(pp=2, micro_batches=8, schedule="gpipe"),
         "pp2_1f1b": Plan(pp=2, micro_batches=8),
         "pp2_interleaved": Plan(pp=2, micro_batches=8, schedule="interleaved", virtual=2),
         "dp2_tp2_pp2": Plan(dp=2, tp=2, pp=2, micro_batches=4)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7, help="rounds (default 7)")
    ap.add_argument("--steps", type=int, default=5, help="calls per timing (default 5)")
    args = ap.parse_args()
    enable_compilation_cache()
    cfg = model_config.preset("tiny8")
    _, params, _ = init_run(TrainConfig(model="tiny8"))
    batch = as_arrays(next(garden.make_corpus(0).train_batches(32)))
    programs = {k: prepared(cfg, params, batch, p) for k, p in PLANS.items()}
    times = round_robin(programs, args.repeats, args.steps)
    result = {"model": "tiny8", "batch": 32, "rounds": args.repeats, "steps": args.steps,
              "plans": {}}
    for name, plan in PLANS.items():
        row = {"median_ms": statistics.median(times[name]) * 1e3,
               "ratio_to_single": statistics.median(
                   a / b for a, b in zip(times[name], times["single"]))}
        if plan.pp > 1:
            t = tick_table(plan.schedule, plan.pp, plan.micro_batches, plan.virtual)
            row["tick_idle_share"] = float(np.mean(t.kind == IDLE))
            row["formula"] = float(sched.bubble_over_total(plan.schedule, plan.pp,
                                                         plan.micro_batches, plan.virtual))
        result["plans"][name] = row
        print(f"{name}: {row['ratio_to_single']:.2f}x"
              + (f", idle {row['tick_idle_share']:.3f} (formula {row['formula']:.3f})"
                 if "formula" in row else ""), file=sys.stderr)
    out = ROOT / "benchmarks" / "results" / "model_parallel.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
