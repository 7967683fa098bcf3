"""Benchmark: how long a checkpoint holds training up, sync against async; bytes; restores.

    python benchmarks/checkpoint.py [--repeats 5] [--models tiny,small,large-cpu] [--json]

On 8 forced CPU devices, per model (tiny, small, and `large-cpu`: an ad-hoc 8-layer,
d_model 512 model of 25.3M parameters, the largest that keeps this benchmark within a few
minutes on 2 cores), the state after two AdamW steps under Plan(dp=8, zero_stage=3) (and
the same state laid out for the single-device Plan()) is saved with jaxscale.training.checkpoint.manager's
Checkpointer, as `train` does: `to_canonical` (timed on its own), then `save`. Sync
(async_save=False) and async saves alternate round-robin, each in its own directory
(keep=2), one untimed warm-up save each first. Recorded per round:

- sync: to_canonical, the save call (the time training is blocked), and any wait after it
- async: to_canonical, the save call (blocked), then `manager.wait_until_finished()` (the
  background write, delta_w), and the checkpoint digest alone (part of the blocked time)
- both: Orbax's CheckpointManager.save inside the save call (the rest is the digest)

The ratio async blocked / sync blocked (blocked = to_canonical + save call: what training
waits for) is the median of the per-round ratios; target <= 0.10. Beside it, the same ratio
for the save call alone and for Orbax's part alone, which shows what holds training up.

Bytes: the canonical state (sum of leaf nbytes), what each device holds of it and what it
writes (its shards with replica_id 0: Orbax writes a replicated tensor once), and the bytes
on disk per checkpoint (Orbax compresses with zstd). Restores of the dp=8 ZeRO-3
checkpoint: into the same plan, and with resharding into Plan(dp=2, tp=2, pp=2,
micro_batches=4) and the single-device Plan(): Orbax's read into the plan's canonical
target (with the digest check), and `from_canonical`, each timed (medians, after a warm-up
restore). Writes benchmarks/results/checkpoint.json.
"""
import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxscale.runtime.devices import force_cpu_devices  # noqa: E402

force_cpu_devices(8)

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxscale import garden  # noqa: E402
from jaxscale.model import transformer as M  # noqa: E402
from jaxscale.training.checkpoint.manager import Checkpointer, CheckpointOptions  # noqa: E402
from jaxscale.training.checkpoint.meta import run_meta, versions  # noqa: E402
from jaxscale.training.checkpoint.store import dir_bytes, listing  # noqa: E402
from jaxscale.training.checkpoint.tensors import digest as _digest, flat_items  # noqa: E402
from jaxscale.runtime.compile_cache import enable_compilation_cache  # noqa: E402
from jaxscale.parallel.plan import Plan  # noqa: E402
from jaxscale.parallel.build import build_train_step  # noqa: E402
from jaxscale.training.config import TrainConfig, lr_schedule, make_optimizer
from jaxscale.training.reference import as_arrays
from jaxscale.model import config as model_config

BATCH = 8
TARGET = 0.10
# the largest model this benchmark saves: 25.3M parameters, a 304 MB AdamW state
LARGE = model_config.ModelConfig(vocab_size=len(garden.VOCAB), seq_len=64, d_model=512, n_layers=8,
                      n_heads=8, d_ff=2048)
MODELS = {"tiny": model_config.preset("tiny"), "small": model_config.preset("small"), "large-cpu": LARGE}
SAVE_PLANS = {"dp8_zero3": Plan(dp=8, zero_stage=3), "single": Plan()}
RESTORE_PLANS = {"dp8_zero3": Plan(dp=8, zero_stage=3),
                 "dp2_tp2_pp2_m4": Plan(dp=2, tp=2, pp=2, micro_batches=4),
                 "single": Plan()}


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def median(xs):
    return statistics.median(xs)


def trained_state(name, mcfg, plan, optimizer, batches):
    """The plan's step and its state after two training steps (so that the optimizer's
    moments are not zeros, which zstd would shrink to nothing); the second step's time."""
    params = nnx.to_pure_dict(nnx.split(M.build(mcfg, seed=0), nnx.Param)[1])
    init, step = build_train_step(mcfg, plan, optimizer)
    state = init(params)
    state, _ = step(state, batches[0])
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    state, _ = step(state, batches[1])
    jax.block_until_ready(state)
    return step, state, time.perf_counter() - t0


def meta_for(name, mcfg, cfg, plan):
    return run_meta(cfg, plan, 2 * BATCH, [], [], [], 0, model=mcfg)


def shard_bytes(tree) -> dict:
    """What each device holds of a canonical state and what it writes (replica 0)."""
    held, written = defaultdict(int), defaultdict(int)
    replicated = 0
    leaves = jax.tree.leaves(tree)
    for leaf in leaves:
        if leaf.sharding.is_fully_replicated:
            replicated += leaf.nbytes
        for s in leaf.addressable_shards:
            held[s.device.id] += s.data.nbytes
            if s.replica_id == 0:
                written[s.device.id] += s.data.nbytes
    return {"canonical_bytes": sum(x.nbytes for x in leaves), "tensors": len(leaves),
            "replicated_tensor_bytes": replicated,
            "held_per_device": dict(sorted(held.items())),
            "written_per_device": dict(sorted(written.items())),
            "written_total": sum(written.values()),
            "written_per_device_max": max(written.values()),
            "written_per_device_min": min(written.values())}


def disk_bytes(directory: Path) -> dict:
    rows = [r for r in listing(directory) if r["complete"]]
    last = Path(rows[-1]["path"])
    return {"checkpoint_bytes": rows[-1]["bytes"], "state_bytes": dir_bytes(last / "state"),
            "meta_bytes": dir_bytes(last / "meta"), "steps_kept": [r["step"] for r in rows]}


def timed(manager) -> list:
    """Time each call of an Orbax CheckpointManager's save (the part of
    Checkpointer.save that is Orbax's own) into the returned list."""
    times, save = [], manager.save

    def save_timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return save(*args, **kwargs)
        finally:
            times.append(time.perf_counter() - t)
    manager.save = save_timed
    return times


def bench_saves(step, state, meta, tmp: Path, tag: str, repeats: int) -> dict:
    """Round-robin sync and async saves of `state` (as train saves it); per-round figures."""
    to_c = step.canonical.to_canonical
    ckpts = {kind: Checkpointer(CheckpointOptions(str(tmp / f"{tag}-{kind}"), every=1, keep=2,
                                                  async_save=kind == "async"))
             for kind in ("sync", "async")}
    rounds = {k: defaultdict(list) for k in ckpts}
    orbax = {k: timed(ck.manager) for k, ck in ckpts.items()}
    try:
        for k, ck in ckpts.items():  # warm-up: compiles to_canonical and the digest
            ck.save(0, to_c(state), meta)
            ck.manager.wait_until_finished()
        for r in range(1, repeats + 1):
            order = ("sync", "async") if r % 2 else ("async", "sync")
            for kind in order:
                ck, rec = ckpts[kind], rounds[kind]
                t0 = time.perf_counter()
                canonical = jax.block_until_ready(to_c(state))
                t1 = time.perf_counter()
                ck.save(r, canonical, meta)
                t2 = time.perf_counter()
                ck.manager.wait_until_finished()
                t3 = time.perf_counter()
                rec["to_canonical_s"].append(t1 - t0)
                rec["save_call_s"].append(t2 - t1)
                rec["orbax_save_s"].append(orbax[kind][-1])
                rec["blocked_s"].append(t2 - t0)
                rec["wait_after_s"].append(t3 - t2)
                rec["total_s"].append(t3 - t0)
                if kind == "async":  # the digest alone, computed on the devices
                    t = time.perf_counter()
                    jax.block_until_ready(_digest(flat_items(canonical)))
                    rec["digest_s"].append(time.perf_counter() - t)
                del canonical
    finally:
        for ck in ckpts.values():
            ck.close()
    out = {k: {"median": {m: median(v) for m, v in rec.items()}, "rounds": dict(rec)}
           for k, rec in rounds.items()}
    s, a = rounds["sync"], rounds["async"]
    out["ratio_async_to_sync_blocked"] = median(x / y for x, y in zip(a["blocked_s"], s["blocked_s"]))
    out["ratio_async_to_sync_save_call"] = median(
        x / y for x, y in zip(a["save_call_s"], s["save_call_s"]))
    # what would remain without jaxscale's own synchronous work (to_canonical, the digest)
    out["ratio_async_orbax_part_to_sync_blocked"] = median(
        x / y for x, y in zip(a["orbax_save_s"], s["blocked_s"]))
    out["meets_target"] = out["ratio_async_to_sync_blocked"] <= TARGET
    out["disk"] = disk_bytes(tmp / f"{tag}-sync")
    out["disk_async"] = disk_bytes(tmp / f"{tag}-async")
    out["bytes"] = shard_bytes(jax.block_until_ready(to_c(state)))
    out["write_MB_per_s_async_background"] = (
        out["disk"]["state_bytes"] / 1e6 / out["async"]["median"]["wait_after_s"])
    return out


def bench_restores(directory: Path, mcfg, optimizer, config: dict, repeats: int) -> dict:
    out = {}
    reader = Checkpointer(CheckpointOptions(str(directory), resume=True))
    try:
        for pname, plan in RESTORE_PLANS.items():
            _, step = build_train_step(mcfg, plan, optimizer)
            can = step.canonical
            rec = defaultdict(list)
            for r in range(repeats + 1):  # the first one warms up (compiles)
                t0 = time.perf_counter()
                saved_step, canonical, _ = reader.restore(can, config)
                jax.block_until_ready(canonical)
                t1 = time.perf_counter()
                st = jax.block_until_ready(can.from_canonical(canonical))
                t2 = time.perf_counter()
                if r:
                    rec["read_s"].append(t1 - t0)
                    rec["from_canonical_s"].append(t2 - t1)
                    rec["total_s"].append(t2 - t0)
                del canonical, st
            out[pname] = {"plan": plan.layout(), "step": saved_step,
                          "median": {m: median(v) for m, v in rec.items()}, "rounds": dict(rec)}
            log(f"    restore into {pname}: read {out[pname]['median']['read_s']:.3f} s + "
                f"from_canonical {out[pname]['median']['from_canonical_s']:.3f} s")
    finally:
        reader.close()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds (default 5)")
    ap.add_argument("--models", default=",".join(MODELS),
                    help=f"comma-separated, of {', '.join(MODELS)} (default all)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "checkpoint.json"))
    args = ap.parse_args()
    names = args.models.split(",")
    bad = [n for n in names if n not in MODELS]
    if bad:
        ap.error(f"unknown model(s) {', '.join(bad)}; choose from {', '.join(MODELS)}")
    enable_compilation_cache()
    t_start = time.perf_counter()
    corpus = garden.make_corpus(0, 64, 8)
    it = corpus.train_batches(BATCH)
    batches = [as_arrays(next(it)) for _ in range(2)]
    models = {}
    tmp = Path(tempfile.mkdtemp(prefix="jaxscale-checkpoint-bench-"))
    try:
        for name in names:
            mcfg = MODELS[name]
            cfg = TrainConfig(model=name, batch_size=BATCH, mesh="dp=8", zero_stage=3)
            optimizer = make_optimizer(cfg.optimizer, lr_schedule(cfg))
            log(f"{name} ({model_config.param_count(mcfg):,} parameters)")
            step, state, step_s = trained_state(name, mcfg, SAVE_PLANS["dp8_zero3"],
                                                optimizer, batches)
            res = {"parameters": model_config.param_count(mcfg), "model": asdict(mcfg),
                   "train_step_s_dp8_zero3": step_s, "saves": {}}
            canonical = step.canonical.to_canonical(state)
            for pname, plan in SAVE_PLANS.items():
                if pname != "dp8_zero3":  # the same trained state, laid out for this plan
                    _, step = build_train_step(mcfg, plan, optimizer)
                    state = step.canonical.from_canonical(
                        jax.device_put(canonical, step.canonical.shardings))
                meta = meta_for(name, mcfg, cfg, plan)
                r = bench_saves(step, state, meta, tmp, f"{name}-{pname}", args.repeats)
                r["plan"] = plan.layout()
                res["saves"][pname] = r
                log(f"  save from {pname}: sync blocked {r['sync']['median']['blocked_s']:.3f} s, "
                    f"async blocked {r['async']['median']['blocked_s']:.3f} s (+ background "
                    f"{r['async']['median']['wait_after_s']:.3f} s), ratio "
                    f"{r['ratio_async_to_sync_blocked']:.3f} (target <= {TARGET}; Orbax's "
                    f"part alone {r['ratio_async_orbax_part_to_sync_blocked']:.3f}); "
                    f"{r['disk']['checkpoint_bytes'] / 1e6:.2f} MB on disk, canonical "
                    f"{r['bytes']['canonical_bytes'] / 1e6:.2f} MB")
            del canonical, state
            res["restores_from_dp8_zero3"] = bench_restores(
                tmp / f"{name}-dp8_zero3-sync", mcfg, optimizer, asdict(cfg), args.repeats)
            models[name] = res
            for p in tmp.iterdir():  # this model's checkpoints: the disk holds one at a time
                shutil.rmtree(p)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ratios = {f"{n}/{p}": s["ratio_async_to_sync_blocked"]
              for n, r in models.items() for p, s in r["saves"].items()}
    result = {
        "benchmark": "checkpoint", "devices": 8, "batch": BATCH, "repeats": args.repeats,
        "target": f"async blocked / sync blocked <= {TARGET}",
        "ratios_async_to_sync_blocked": ratios,
        "meets_target": {k: v <= TARGET for k, v in ratios.items()},
        "definitions": {
            "blocked_s": "to_canonical (block_until_ready) + Checkpointer.save: what the "
                         "training loop waits for",
            "save_call_s": "Checkpointer.save alone (digest + Orbax's synchronous part)",
            "wait_after_s": "manager.wait_until_finished() after the save call: the "
                            "background write (async; ~0 for sync)",
            "orbax_save_s": "Orbax's CheckpointManager.save inside save_call_s (the rest "
                            "is the digest and the meta dict)",
            "digest_s": "jaxscale.training.checkpoint.tensors.digest of the state alone, timed after the "
                        "round (inside save_call_s)",
            "ratio_async_orbax_part_to_sync_blocked": "async orbax_save_s / sync blocked_s: "
                                                      "the ratio without to_canonical and "
                                                      "the digest",
            "absl_warnings": "Orbax's 'Waiting for previous save to complete took ...' "
                             "counts the benchmark's own wait_until_finished() after the "
                             "previous save, not a wait inside the next one",
            "written_per_device": "bytes of the canonical shards a device holds with "
                                  "replica_id 0 (Orbax writes each replicated shard once)",
            "checkpoint_bytes": "files of one step directory (zstd-compressed tensors + "
                                "metadata + meta JSON)"},
        "machine": {"cpus": os.cpu_count(), "machine": platform.machine(),
                    "python": platform.python_version(), "platform": platform.platform()},
        "versions": versions(), "tmp_dir_filesystem": tempfile.gettempdir(),
        "wall_s": round(time.perf_counter() - t_start, 1), "models": models}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    log(f"wrote {out} in {result['wall_s']:.0f} s")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
