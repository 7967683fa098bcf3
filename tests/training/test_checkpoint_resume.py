"""Resuming for real: in a new process, under other plans, after SIGKILLs, on a full disk.

    - every strategy of compare's default set: 8 steps straight against 4, a NEW process
      resuming 4 more: loss curve and final state bit-identical (max abs diff 0.0); also
      fp16 with dynamic loss scaling and micro-batches, its warm-up ending at the save.
      (It was 40 against 20: what the property needs is that every piece of state has
      moved before the save (parameters, both Adam moments, the step counter that drives
      the learning-rate schedule, fp16's scale and its count of finite steps) and that the
      schedule is still changing across it; 4 steps give all of that, and a resumed
      process that went wrong in any of them parts from the straight run at its first
      step, not its twentieth.) And fp8-delayed under 3-D: its amax histories resume too.
    - saved under zero3 dp=8, 3-D and tp=4, resumed under five other plans: every step
      within 1e-5 relative of the uninterrupted single-device run
    - 7 SIGKILLs, each at a named phase of a save (checkpoint/crash.py: before writing,
      while writing, after the commit), sync and async: the resumed curve equals the
      uninterrupted one bit for bit; incomplete saves are never used. (It was 21 kills over
      300 steps, then 12 over 128: placed by the hook, a kill is one of six cases (3 phases
      x sync/async); 7 meet each case once, and each by a run that itself resumed from a
      killed one (the first case twice: first in a fresh run, last in a resumed one). A
      round advances 4 or 8 steps, so the kills cover at most 56 of the 64.)
    - a disk that refuses writes mid-save: the save fails loudly, the previous checkpoint
      stays whole
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from dataclasses import replace

import numpy as np
import pytest

from conftest import CACHE, ROOT, run_python
from jaxscale.training.checkpoint import manager as C
from jaxscale.training.checkpoint import crash, store, tensors
from jaxscale.compare.strategies import STRATEGIES, strategy_plan
from jaxscale.model.config import preset
from jaxscale.training.config import TrainConfig
from jaxscale.training.loop import train

pytestmark = pytest.mark.slow

BASE = TrainConfig(model="tiny", steps=8, eval_every=4, warmup=2, n_train_docs=512,
                   n_val_docs=16)
SAVE = 4  # the step the resumed run starts from
# warmup=6 is cut to half the run (training.config.warmup_steps: 4 of 8), so the warm-up's
# last step is the save's and the resumed run starts at the peak of the cosine decay: a
# resumed step counter that went wrong would show at once (lr 0 at count 0)
FP16 = replace(BASE, precision="fp16", micro_batches=2, warmup=6)


def _config(strategy: str, base=BASE) -> TrainConfig:
    """The run of `strategy` as compare lays it out on 8 devices (cp and sequence
    parallelism included: until session 15 they were dropped, and "cp" ran on one device)."""
    plan = strategy_plan(strategy, 8, preset(base.model))
    cfg = replace(base, mesh=f"dp={plan.dp},pp={plan.pp},tp={plan.tp},cp={plan.cp}",
                  zero_stage=plan.zero_stage, sequence_parallel=plan.sequence_parallel,
                  micro_batches=max(plan.micro_batches, base.micro_batches),
                  schedule=plan.schedule, virtual=plan.virtual)
    assert cfg.plan().layout() == replace(plan, micro_batches=cfg.micro_batches).layout()
    return cfg


# fp8-delayed's amax histories are state too (two steps long: full, and rolled, at the
# save), split over pp with their layers, the head's with them
FP8_DELAYED = replace(_config("3d"), precision="fp8-delayed", fp8_history=2, fp8_head=True)
CASES = {name: _config(name) for name in STRATEGIES} | {"fp16 micro-batches": FP16,
                                                       "fp8-delayed 3d": FP8_DELAYED}

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
                  checkpoint=CheckpointOptions(directory, every=4, resume=True))
        out[name] = {"loss_curve": r.loss_curve, "resumed_from": r.resumed_from}
    print(json.dumps(out))
""")


def test_every_default_strategy_resumes_bit_for_bit_in_a_new_process(tmp_path):
    from dataclasses import asdict

    jobs, straight = {}, {}
    for name, cfg in CASES.items():
        d = tmp_path / name.replace(" ", "_")
        straight[name] = train(cfg, progress=False,
                               checkpoint=C.CheckpointOptions(str(d / "straight"), every=SAVE))
        # the resumed run starts from a copy of the straight run's step-4 checkpoint
        (d / "resumed").mkdir()
        shutil.copytree(d / "straight" / str(SAVE), d / "resumed" / str(SAVE))
        jobs[name] = (asdict(cfg), str(d / "resumed"))
    proc = run_python(RESUME, json.dumps(jobs), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in CASES:
        assert resumed[name]["resumed_from"] == SAVE
        assert resumed[name]["loss_curve"] == straight[name].loss_curve, name
        a = tensors.read_canonical(tmp_path / name.replace(" ", "_") / "straight", BASE.steps)
        b = tensors.read_canonical(jobs[name][1], BASE.steps)
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
# SIGKILL at every phase of a save
# --------------------------------------------------------------------------------------

KILL_STEPS = 64  # the kills' rounds advance at most 56 steps; the last run finishes the rest
KILL_ARGS = ["--model", "tiny", "--steps", str(KILL_STEPS), "--eval-every", "1000",
             "--batch-size", "8", "--train-docs", "512", "--checkpoint-every", "4", "--keep",
             "2", "--json"]
KILLS = 7  # 3 phases x sync/async once each, the first again from a resumed run


def _jaxscale(args, env=None, **kw):
    full = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", crash.ENV)}
    full.update(JAXSCALE_CACHE_DIR=str(CACHE), **(env or {}))
    return subprocess.Popen([sys.executable, "-m", "jaxscale", "train", *args], cwd=ROOT,
                            env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def _incomplete(d):
    return [r for r in store.listing(d) if not r["complete"]] if d.exists() else []


def test_sigkill_at_every_phase_of_a_save_resumes_bit_for_bit(tmp_path):
    """Each round starts a run (resuming from the latest complete checkpoint) that kills
    itself (SIGKILL) at a phase of its second save (crash.PHASES: before anything is
    written, while Orbax writes the step, after the commit before the file list), so every
    round makes progress and a third of the kills leave a half-written step behind. The
    run finished after all of them equals an uninterrupted one bit for bit, every step of
    the loss curve and every tensor of the final state, and no incomplete step is used."""
    ref = _jaxscale([*KILL_ARGS, "--checkpoint-dir", str(tmp_path / "ref"), "--out",
                     str(tmp_path / "ref-out")])
    d = tmp_path / "ck"
    kills = during_save = 0
    for i in range(KILLS):
        phase = crash.PHASES[i % len(crash.PHASES)]
        before = max(store.complete_steps(d), default=0)
        p = _jaxscale([*KILL_ARGS, "--checkpoint-dir", str(d), "--out", str(tmp_path / "out"),
                       *(["--resume"] if before else []),
                       *(["--async-checkpoint"] if (i // len(crash.PHASES)) % 2 else [])],
                      env={crash.ENV: f"{phase}@2"})
        _, err = p.communicate(timeout=300)
        assert p.returncode == -signal.SIGKILL, (phase, p.returncode, err.decode()[-2000:])
        kills += 1
        assert max(store.complete_steps(d)) > before  # its first save is whole
        left = _incomplete(d)
        during_save += bool(left)
        assert bool(left) == (phase == "writing"), (phase, left)
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
    a, b = tensors.read_canonical(d, KILL_STEPS), tensors.read_canonical(tmp_path / "ref",
                                                                      KILL_STEPS)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    print(f"{kills} kills, {during_save} of them during a save")
    assert kills == KILLS and during_save >= KILLS // 3


def test_a_malformed_crash_point_is_refused_by_name(tmp_path):
    p = _jaxscale([*KILL_ARGS, "--checkpoint-dir", str(tmp_path / "ck"), "--out",
                   str(tmp_path / "out")], env={crash.ENV: "later@2"})
    _, err = p.communicate(timeout=300)
    assert p.returncode != 0 and "start, writing, written" in err.decode(), err.decode()[-2000:]


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
