"""Benchmark: the data-parallel step on 8 forced CPU devices.

    python benchmarks/data_parallel.py [--repeats 30]

Measures, in one process and interleaved: the single-device step, the shard_map DP step
(jaxscale.parallel), and the same step compiled by GSPMD (plain jit with NamedShardings:
XLA inserts the gradient all-reduce itself). Reports medians and the ratios
shard_map / single and shard_map / GSPMD (target <= 1.05). Writes
benchmarks/results/data_parallel.json. On a 2-core machine the 8 "devices" share 2 cores:
the ratios say how the programs compare, not how DP scales on real hardware.
"""
import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jaxscale.runtime.devices import force_cpu_devices  # noqa: E402

force_cpu_devices(8)

import jax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from jaxscale import garden  # noqa: E402
from jaxscale.measure import timing  # noqa: E402
from jaxscale.model import optim, precision  # noqa: E402
from jaxscale.parallel.plan import Plan  # noqa: E402
from jaxscale.parallel.build import build_train_step  # noqa: E402
from jaxscale.training.config import TrainConfig  # noqa: E402
from jaxscale.training.reference import as_arrays, init_run  # noqa: E402
from jaxscale.model import config as model_config
from jaxscale.parallel import step as steplib

ROOT = Path(__file__).resolve().parents[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    cfg, opt, pol = model_config.preset("tiny"), optim.adamw(3e-3), precision.policy("fp32")
    graphdef, params, _ = init_run(TrainConfig())
    batch = as_arrays(next(garden.make_corpus(0).train_batches(32)))

    init1, step1 = build_train_step(cfg, Plan(), opt)
    init8, step8 = build_train_step(cfg, Plan(dp=8), opt)
    s1, s8 = init1(params), init8(params)
    placed = step8.place_batch(batch)

    mesh = step8.mesh
    rep, shard = NamedSharding(mesh, P()), NamedSharding(mesh, P("dp"))
    gspmd = jax.jit(steplib.make_step(graphdef, opt, pol, jit=False),
                    in_shardings=(rep, shard), out_shardings=(rep, rep))

    fns = {"single": lambda: step1(s1, batch),
           "shard_map_dp8": lambda: step8.jitted(s8, placed),
           "gspmd_dp8": lambda: gspmd(s8, placed)}
    results = {k: [] for k in fns}
    for _ in range(3):  # interleave rounds so that machine noise hits all three alike
        for k, f in fns.items():
            results[k].append(timing.step_seconds(f, repeats=args.repeats // 3)["median_s"])
    med = {k: sorted(v)[len(v) // 2] for k, v in results.items()}
    out = {"benchmark": "data_parallel", "median_step_s": med,
           "ratio_shard_map_to_single": med["shard_map_dp8"] / med["single"],
           "ratio_shard_map_to_gspmd": med["shard_map_dp8"] / med["gspmd_dp8"],
           "target_shard_map_to_gspmd": 1.05, "rounds": results, "cpus": os.cpu_count()}
    out["meets_target"] = out["ratio_shard_map_to_gspmd"] <= 1.05
    path = ROOT / "benchmarks" / "results" / "data_parallel.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"median step: single {med['single'] * 1e3:.2f} ms, shard_map dp=8 "
          f"{med['shard_map_dp8'] * 1e3:.2f} ms, GSPMD dp=8 {med['gspmd_dp8'] * 1e3:.2f} ms; "
          f"shard_map/single {out['ratio_shard_map_to_single']:.3f}, shard_map/GSPMD "
          f"{out['ratio_shard_map_to_gspmd']:.3f} (target <= 1.05)")


if __name__ == "__main__":
    main()
