"""Benchmark: a checkpoint's save when its tensors are replicated, Orbax's default handler
against jaxscale's (checkpoint/tensors.py: one replica writes a tensor under 1 MiB a slice).

    python benchmarks/checkpoint_replicas.py [--repeats 3] [--saves 4] [--json]

Orbax cuts a tensor held whole by several devices into one slice per replica, each an eager
slice on its device, compiled the first time a shape is seen. Per layout of the `tiny` model
on 8 forced CPU devices (dp=8 and tp=4, whose canonical state is replicated; 3-D with
ZeRO-1, partly replicated; dp=8 ZeRO-3, sharded, as the control), each run is a fresh
process (no compilation cache) that builds the state after one AdamW step, converts it to
the canonical form, and saves it `--saves` times with a Checkpointer: the first save (with
whatever it compiles) and the median of the later ones. The two handlers alternate, run by
run, `--repeats` runs each; the figures are medians over the runs, and the ratio is
jaxscale's over Orbax's default, measured in the same invocation. Every run also reads its
last checkpoint back and hashes every tensor: both handlers must write the same values.
Writes benchmarks/results/checkpoint_replicas.json.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "checkpoint_replicas.json"
LAYOUTS = {"dp=8": dict(dp=8), "tp=4": dict(tp=4),
           "3d zero1": dict(dp=2, tp=2, pp=2, micro_batches=4, zero_stage=1),
           "dp=8 zero3 (sharded)": dict(dp=8, zero_stage=3)}
HANDLERS = ("orbax default", "jaxscale")

ONE_RUN = """
import hashlib, json, statistics, sys, tempfile, time
from jaxscale.runtime.devices import force_cpu_devices
force_cpu_devices(8)
import jax, numpy as np
from jaxscale import garden
from jaxscale.model import config as model_config
from jaxscale.parallel.build import build_train_step
from jaxscale.parallel.plan import Plan
from jaxscale.training.checkpoint import manager as C, tensors
from jaxscale.training.config import TrainConfig
from jaxscale.training.reference import as_arrays, init_run
handler, plan, saves = sys.argv[1], Plan(**json.loads(sys.argv[2])), int(sys.argv[3])
if handler == "orbax default":
    tensors._handler_set = True  # the Checkpointer leaves Orbax's registry as it is
cfg = TrainConfig(model="tiny")
_, params, optimizer = init_run(cfg)
init, step = build_train_step(model_config.preset("tiny"), plan, optimizer,
                              jax.devices()[:plan.n_devices])
batch = as_arrays(next(garden.make_corpus(0).train_batches(32, seed=3)))
state, _ = step(init(params), batch)
canonical = jax.block_until_ready(step.canonical.to_canonical(state))
d = tempfile.mkdtemp()
seconds = []
with C.Checkpointer(C.CheckpointOptions(d, every=1, keep=2)) as ckpt:
    for s in range(1, saves + 1):
        t = time.perf_counter()
        ckpt.save(s, canonical, {})
        seconds.append(time.perf_counter() - t)
items = tensors.read_canonical(d, saves)
digest = hashlib.sha256(b"".join(np.ascontiguousarray(items[k]).tobytes()
                                 for k in sorted(items))).hexdigest()
print(json.dumps({"first_s": seconds[0], "later_s": statistics.median(seconds[1:]),
                  "sha256": digest}))
"""


def one_run(handler: str, plan: dict, saves: int) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, "-c", ONE_RUN, handler, json.dumps(plan),
                           str(saves)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode:
        raise SystemExit(f"{handler} {plan}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="runs per handler and layout")
    ap.add_argument("--saves", type=int, default=4, help="saves per run (>= 2)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.saves < 2:
        ap.error(f"--repeats must be >= 1 and --saves >= 2 (got {args.repeats}, {args.saves})")
    rows = {}
    for name, plan in LAYOUTS.items():
        runs = {h: [] for h in HANDLERS}
        for r in range(args.repeats):
            for h in (HANDLERS if r % 2 == 0 else HANDLERS[::-1]):  # alternate who goes first
                runs[h].append(one_run(h, plan, args.saves))
                print(f"{name:22} {h:14} run {r + 1}: first {runs[h][-1]['first_s']:.2f} s, "
                      f"later {runs[h][-1]['later_s']:.3f} s", file=sys.stderr, flush=True)
        med = {h: {k: statistics.median(x[k] for x in runs[h]) for k in ("first_s", "later_s")}
               for h in HANDLERS}
        shas = {x["sha256"] for h in HANDLERS for x in runs[h]}
        rows[name] = {"plan": plan, **{h: {**med[h], "runs": runs[h]} for h in HANDLERS},
                      "first_ratio": med["jaxscale"]["first_s"] / med["orbax default"]["first_s"],
                      "later_ratio": med["jaxscale"]["later_s"] / med["orbax default"]["later_s"],
                      "same_values": len(shas) == 1}
    result = {"benchmark": "checkpoint_replicas", "model": "tiny", "devices": 8,
              "repeats": args.repeats, "saves": args.saves, "cpus": os.cpu_count(),
              "rows": rows}
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for name, row in rows.items():
            print(f"{name:22} first save {row['orbax default']['first_s']:.2f} s -> "
                  f"{row['jaxscale']['first_s']:.2f} s ({row['first_ratio']:.2f}x), later "
                  f"{row['orbax default']['later_s']:.3f} s -> {row['jaxscale']['later_s']:.3f}"
                  f" s ({row['later_ratio']:.2f}x), same values: {row['same_values']}")
    return 0 if all(row["same_values"] for row in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
