"""Resuming for real: in a new process, under other plans, after SIGKILLs, on a full disk.

    - every strategy of compare's default set: 40 steps straight against 20, a NEW process
      resuming 20 more: loss curve and final state bit-identical (max abs diff 0.0); also
      fp16 with dynamic loss scaling, micro-batches and a warm-up that crosses the save
    - saved under zero3 dp=8, 3-D and tp=4, resumed under five other plans: every step
      within 1e-5 relative of the uninterrupted single-device run
    - 20+ SIGKILLs at random instants, many during a save (sync and async): the resumed
      curve equals the uninterrupted one bit for bit; incomplete saves are never used
    - a disk that refuses writes mid-save: the save fails loudly, the previous checkpoint
      stays whole
"""
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace

import numpy as np
import pytest

from conftest import CACHE, ROOT, run_python
from jaxscale.training.checkpoint import manager as C
from jaxscale.training.checkpoint import store, tensors
from jaxscale.compare.strategies import STRATEGIES, strategy_plan
from jaxscale.model.config import preset
from jaxscale.training.config import TrainConfig
from jaxscale.training.loop import train

pytestmark = pytest.mark.slow

BASE = TrainConfig(model="tiny", steps=40, eval_every=20, warmup=10, n_train_docs=512,
                   n_val_docs=16)
FP16 = replace(BASE, precision="fp16", micro_batches=2, warmup=30)  # warm-up crosses step 20


def _config(strategy: str, base=BASE) -> TrainConfig:
    plan = strategy_plan(strategy, 8, preset(base.model))
    return replace(base, mesh=f"dp={plan.dp},pp={plan.pp},tp={plan.tp}",
                   zero_stage=plan.zero_stage,
                   micro_batches=max(plan.micro_batches, base.micro_batches),
                   schedule=plan.schedule, virtual=plan.virtual)


CASES = {name: _config(name) for name in STRATEGIES} | {"fp16 micro-batches": FP16}

RESUME = textwrap.dedent("""
    import json, sys
    from dataclasses import replace
    from jaxscale.runtime import devices
    devices.force_cpu_devices(8)
    from jaxscale.training.checkpoint.manager import CheckpointOptions
    from jaxscale.training.config import TrainConfig
    from jaxscale.training.loop import train
    out = {}
    for name, (cfg, directory) in json.loads(sys.argv[1]).items():
        r = train(TrainConfig(**cfg), progress=False,
                  checkpoint=CheckpointOptions(directory, every=20, resume=True))
        out[name] = {"loss_curve": r.loss_curve, "resumed_from": r.resumed_from}
    print(json.dumps(out))
""")


def test_every_default_strategy_resumes_bit_for_bit_in_a_new_process(tmp_path):
    from dataclasses import asdict

    jobs, straight = {}, {}
    for name, cfg in CASES.items():
        d = tmp_path / name.replace(" ", "_")
        straight[name] = train(cfg, progress=False,
                               checkpoint=C.CheckpointOptions(str(d / "straight"), every=20))
        # the resumed run starts from a copy of the straight run's step-20 checkpoint
        (d / "resumed").mkdir()
        shutil.copytree(d / "straight" / "20", d / "resumed" / "20")
        jobs[name] = (asdict(cfg), str(d / "resumed"))
    proc = run_python(RESUME, json.dumps(jobs), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in CASES:
        assert resumed[name]["resumed_from"] == 20
        assert resumed[name]["loss_curve"] == straight[name].loss_curve, name
        a = tensors.read_canonical(tmp_path / name.replace(" ", "_") / "straight", 40)
        b = tensors.read_canonical(jobs[name][1], 40)
        assert max(float(np.max(np.abs(a[k].astype(np.float64) - b[k]))) for k in a) == 0.0, name
    assert straight["fp16 micro-batches"].loss_scale > 0  # its state carries the scale too


SOURCES = {"zero3 dp=8": dict(mesh="dp=8", zero_stage=3),
           "3d": dict(mesh="dp=2,pp=2,tp=2", micro_batches=4, zero_stage=1),
           "tp=4": dict(mesh="tp=4")}
TARGETS = {"single": {}, "dp=4": dict(mesh="dp=4"),
           "zero1 dp=2": dict(mesh="dp=2", zero_stage=1, micro_batches=2),
           "tp=2,pp=2": dict(mesh="pp=2,tp=2", micro_batches=4),
           "interleaved": dict(mesh="pp=2", micro_batches=4, schedule="interleaved",
                               virtual=2)}
MODEL8 = replace(BASE, model="tiny8", steps=8, eval_every=4, warmup=2)


def test_resuming_under_other_plans_stays_near_the_single_device_run(tmp_path):
    single = train(MODEL8, progress=False).loss_curve
    for source, fields in SOURCES.items():
        d = tmp_path / source.replace(" ", "_")
        train(replace(MODEL8, **fields), progress=False, halt_after=4,
              checkpoint=C.CheckpointOptions(str(d), every=4))
        for target, other in TARGETS.items():
            r = train(replace(MODEL8, **other), progress=False,
                      checkpoint=C.CheckpointOptions(str(d), resume=True))
            assert r.resumed_from == 4
            rel = np.abs(np.subtract(r.loss_curve, single)) / np.abs(single)
            assert rel.max() <= 1e-5, (source, target, rel.max())


# --------------------------------------------------------------------------------------
# SIGKILL at random instants
# --------------------------------------------------------------------------------------

KILL_ARGS = ["--model", "tiny", "--steps", "300", "--eval-every", "1000", "--batch-size", "8",
             "--checkpoint-every", "4", "--keep", "2", "--json"]
KILLS = 20


def _jaxscale(args, **kw):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAXSCALE_CACHE_DIR"] = str(CACHE)
    return subprocess.Popen([sys.executable, "-m", "jaxscale", "train", *args], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def _incomplete(d):
    return [r for r in store.listing(d) if not r["complete"]] if d.exists() else []


def _saving(d) -> bool:
    return any(store.TMP_MARK in x.name for x in d.glob("*"))


def _kill_once(d, args, rng, during_save: bool, timeout=120.0):
    """Start a run, wait until it has saved one new checkpoint (so every round makes
    progress), then SIGKILL it: the moment its next save starts (+ 0-40 ms), or at a
    random instant within the next 1.5 s. False if the run finished first."""
    before = max(store.complete_steps(d), default=0)
    p = _jaxscale(args)
    deadline = time.monotonic() + timeout
    while max(store.complete_steps(d), default=0) <= before and p.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.005)
    if during_save:
        while not _saving(d) and p.poll() is None:
            time.sleep(0.001)
        time.sleep(rng.uniform(0, 0.04))
    else:
        time.sleep(rng.uniform(0, 1.5))
    if p.poll() is not None:
        return False
    p.send_signal(signal.SIGKILL)
    p.communicate()
    return True


def test_sigkill_at_random_instants_resumes_bit_for_bit(tmp_path):
    ref = _jaxscale([*KILL_ARGS, "--checkpoint-dir", str(tmp_path / "ref"), "--out",
                     str(tmp_path / "ref-out")])
    d, rng = tmp_path / "ck", random.Random(14)
    kills = during_save = 0
    for i in range(KILLS):
        args = [*KILL_ARGS, "--checkpoint-dir", str(d), "--out", str(tmp_path / "out"),
                *(["--resume"] if store.complete_steps(d) else []),
                *(["--async-checkpoint"] if i % 2 else [])]  # sync and async saves alike
        assert _kill_once(d, args, rng, during_save=i % 3 != 2), "finished before the kill"
        kills += 1
        left = _incomplete(d)
        during_save += bool(left)
        assert all(store.TMP_MARK in r["path"] for r in left)  # listed until the next run
    final = _jaxscale([*KILL_ARGS, "--checkpoint-dir", str(d), "--out", str(tmp_path / "out"),
                       "--resume"])
    out, err = final.communicate(timeout=600)
    assert final.returncode == 0, err.decode()[-2000:]
    assert not _incomplete(d)  # cleaned up, never used
    ref_out, ref_err = ref.communicate(timeout=600)
    assert ref.returncode == 0, ref_err.decode()[-2000:]
    resumed, straight = json.loads(out), json.loads(ref_out)
    assert resumed["resumed_from"] is not None
    assert resumed["loss_curve"] == straight["loss_curve"]  # bit for bit, every step
    a, b = tensors.read_canonical(d, 300), tensors.read_canonical(tmp_path / "ref", 300)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    print(f"{kills} kills, {during_save} of them during a save")
    assert kills >= 20 and during_save >= KILLS // 3


# --------------------------------------------------------------------------------------
# A disk that refuses writes mid-save
# --------------------------------------------------------------------------------------

FULL_DISK = textwrap.dedent("""
    import json, resource, signal, sys
    from jaxscale.training.checkpoint import manager as C
    from jaxscale.training.checkpoint import store
    from jaxscale.training.checkpoint.meta import run_meta
    from jaxscale.training.config import TrainConfig
    from jaxscale.training.reference import init_run
    from jaxscale.model.config import preset
    from jaxscale.parallel.plan import Plan
    from jaxscale.parallel.build import build_train_step
    cfg = TrainConfig(model="tiny")
    _, params, opt = init_run(cfg)
    init, step = build_train_step(preset("tiny"), Plan(), opt)
    canonical = step.canonical.to_canonical(init(params))
    meta = run_meta(cfg, Plan(), 0, [], [], [], 0)
    options = C.CheckpointOptions(sys.argv[1], every=1, async_save=sys.argv[2] == "async")
    ckpt = C.Checkpointer(options)
    ckpt.save(1, canonical, meta)
    ckpt.manager.wait_until_finished()
    # from here on no file may grow past 4 KiB: the kernel answers EFBIG, as a full disk
    # answers ENOSPC (SIGXFSZ ignored, so the write fails instead of killing the process)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    error = None
    try:
        ckpt.save(2, canonical, meta)
        ckpt.close()
    except C.CheckpointWriteError as e:
        error = str(e)
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    print(json.dumps({"error": error, "steps": store.complete_steps(sys.argv[1])}))
""")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_disk_that_refuses_writes_leaves_the_previous_checkpoint_whole(tmp_path, mode):
    proc = run_python(FULL_DISK, str(tmp_path / "ck"), mode, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["error"] and "the checkpoint of step 1 is intact" in got["error"], got
    assert got["steps"] == [1]
    restored = tensors.read_canonical(tmp_path / "ck", 1)
    assert restored and all(np.isfinite(v).all() for v in restored.values())
