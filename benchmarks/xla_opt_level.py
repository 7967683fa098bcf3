"""Benchmark: XLA:CPU's LLVM optimization level, compile seconds against step seconds.

The test suite spends about half its time compiling. XLA:CPU hands each fused kernel to
LLVM at `--xla_backend_optimization_level` (default 3). A lower level compiles faster, and
is usable only where it computes the same numbers: measured here for each program alone.
(Level 1 passed that and still failed the suite: a spike-guarded step and the plain one,
two programs, part by 7e-7 at level 1 and agree bit for bit at level 3.) This measures,
for training steps that cover the suite's kinds (one device, 3-D with ZeRO-1, ZeRO-3,
experts, latent attention, a pipeline), at each level asked for:

  lower_s    tracing and lowering to HLO (the level cannot change it)
  compile_s  XLA's compile of that HLO, the persistent cache off
  step_s     the median of 5 steps once compiled
  same       the parameters after 3 Adam steps, max abs diff against the default level's

Each level runs in its own process (XLA reads its flags once), the levels alternating over
`--repeats` rounds on the otherwise idle machine; the medians are reported.

    python benchmarks/xla_opt_level.py [--levels 3,1] [--repeats 2]

Writes benchmarks/results/xla_opt_level.json.
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
PROGRAMS = {  # name: (model, Plan fields)
    "tiny one device": ("tiny", {}),
    "tiny8 dp2 pp2 tp2 zero1": ("tiny8", dict(dp=2, pp=2, tp=2, micro_batches=4, zero_stage=1)),
    "tiny dp8 zero3": ("tiny", dict(dp=8, zero_stage=3)),
    "tiny-moe dp2 ep2 tp2": ("tiny-moe", dict(dp=2, ep=2, tp=2)),
    "tiny-deepseek dp2 tp2": ("tiny-deepseek", dict(dp=2, tp=2)),
    "tiny8 pp2 interleaved": ("tiny8", dict(pp=2, micro_batches=4, schedule="interleaved",
                                            virtual=2)),
}


def child(out: str) -> None:
    """In a process with the level set in XLA_FLAGS: time and run each program."""
    from jaxscale.runtime.devices import force_cpu_devices
    devices = force_cpu_devices(8)
    import jax
    import numpy as np
    import optax
    from jaxscale import garden
    from jaxscale.model import config as model_config
    from jaxscale.parallel.build import build_train_step
    from jaxscale.parallel.plan import Plan
    from jaxscale.training.config import TrainConfig
    from jaxscale.training.reference import as_arrays, init_run

    batch = as_arrays(next(garden.make_corpus(0, 256, 16).train_batches(32, seed=3)))
    rows, params_out = {}, {}
    for name, (model, fields) in PROGRAMS.items():
        _, params, _ = init_run(TrainConfig(model=model))
        plan = Plan(**fields)
        init, step = build_train_step(model_config.preset(model), plan, optax.adamw(1e-3),
                                      devices[:plan.n_devices])
        state, placed = init(params), step.place_batch(batch)
        t = time.perf_counter()
        lowered = step.jitted.lower(state, placed)
        lower_s = time.perf_counter() - t
        t = time.perf_counter()
        compiled = lowered.compile()
        compile_s = time.perf_counter() - t
        times = []
        for _ in range(5):
            t = time.perf_counter()
            state, metrics = compiled(state, placed)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - t)
        rows[name] = {"lower_s": lower_s, "compile_s": compile_s,
                      "step_s": statistics.median(times)}
        whole = step.full_params(state)
        params_out.update({f"{name}/{i}": np.asarray(x)
                           for i, x in enumerate(jax.tree.leaves(whole))})
    np.savez(out + ".npz", **params_out)
    Path(out + ".json").write_text(json.dumps(rows))


def run_level(level: int, out: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAXSCALE_CACHE_DIR",
                                                            "JAX_COMPILATION_CACHE_DIR")}
    env.update(JAX_PLATFORMS="cpu", JAXSCALE_CACHE_DIR="off")
    if level != 3:
        env["XLA_FLAGS"] = f"--xla_backend_optimization_level={level}"
    subprocess.run([sys.executable, __file__, "--child", str(out)], cwd=ROOT, env=env,
                   check=True)
    return json.loads(Path(str(out) + ".json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", default="3,1", help="comma-separated; 3 is XLA's default")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child)
    import numpy as np
    levels = [int(x) for x in args.levels.split(",")]
    tmp = ROOT / ".cache" / "xla-opt-level"
    tmp.mkdir(parents=True, exist_ok=True)
    runs = {lv: [] for lv in levels}
    for r in range(args.repeats):
        for lv in levels:
            print(f"round {r + 1}/{args.repeats}: level {lv}", file=sys.stderr, flush=True)
            runs[lv].append(run_level(lv, tmp / f"level{lv}-{r}"))
    ref = np.load(tmp / f"level{levels[0]}-0.npz")
    table = {}
    for lv in levels:
        got = np.load(tmp / f"level{lv}-0.npz")
        table[lv] = {name: {k: round(statistics.median(run[name][k] for run in runs[lv]), 4)
                            for k in ("lower_s", "compile_s", "step_s")} for name in PROGRAMS}
        for name in PROGRAMS:
            keys = [k for k in ref.files if k.startswith(name + "/")]
            table[lv][name]["max_abs_diff"] = max(
                float(np.max(np.abs(ref[k].astype(np.float64) - got[k]))) for k in keys)
    base = levels[0]
    totals = {lv: {k: round(sum(table[lv][n][k] for n in PROGRAMS), 3)
                   for k in ("lower_s", "compile_s", "step_s")} for lv in levels}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    result = {"benchmark": "xla_opt_level", "commit": commit, "date": time.strftime("%F"),
              "cpus": os.cpu_count(), "repeats": args.repeats,
              "reference_level": base, "levels": table, "totals": totals,
              "compile_ratio": {lv: round(totals[lv]["compile_s"] / totals[base]["compile_s"], 3)
                                for lv in levels},
              "step_ratio": {lv: round(totals[lv]["step_s"] / totals[base]["step_s"], 3)
                             for lv in levels}}
    out = ROOT / "benchmarks" / "results" / "xla_opt_level.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("totals", "compile_ratio", "step_ratio")}))
    for lv in levels:
        print(lv, {n: table[lv][n]["max_abs_diff"] for n in PROGRAMS})


if __name__ == "__main__":
    main()
