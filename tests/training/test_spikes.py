"""The spike guard, fault injection, rollback, restarts and elastic resumption
(jaxscale.training.spikes, jaxscale.training.supervise, parallel.plan.elastic_micro_batches).

    - a NaN gradient is skipped with the state bitwise unchanged, under every strategy of
      compare's default set; a guard that accepts changes no bit of the plain step
    - an injected bad batch is caught at its step; stop stops there; rollback restores
      the checkpoint bit for bit and skips exactly the batches it reports
    - a crashed run restarted by the supervisor ends bit-identical to a run without crashes
    - resuming on fewer devices keeps the global batch and stays within 1e-5 of the
      uninterrupted run; a device count that cannot keep it is refused with those that can
"""
import json
import math
import shutil
from dataclasses import replace

import jax
import numpy as np
import pytest

from conftest import run_python
from jaxscale.training.checkpoint import manager as C
from jaxscale.training.checkpoint import store, tensors
from jaxscale.cli import main as cli
from jaxscale import garden
from jaxscale.training import spikes
from jaxscale.compare.strategies import STRATEGIES, strategy_plan
from jaxscale.data.sampler import StepBatches
from jaxscale.parallel.plan import Plan, PlanError, elastic_micro_batches
from jaxscale.parallel.build import build_train_step
from jaxscale.training.config import TrainConfig, lr_schedule
from jaxscale.training.reference import init_run
from jaxscale.training.loop import train
from jaxscale.model import config as model_config
from jaxscale.parallel import step as steplib
from jaxscale.training import faults

# the window fills by step 10; the faults come after step 20, when the loss has settled
# enough that a bad batch stands out (at step 15 the early fall of the loss still hides one)
RUN = TrainConfig(model="tiny", steps=40, eval_every=20, warmup=5, n_train_docs=512,
                  n_val_docs=16, spike_policy="skip", spike_window=10)


def bits_equal(a, b) -> bool:
    la, lb = jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b))
    return len(la) == len(lb) and all(np.asarray(x).tobytes() == np.asarray(y).tobytes()
                                      for x, y in zip(la, lb))


# --------------------------------------------------------------------------------------
# Parsing and the statistics
# --------------------------------------------------------------------------------------

def test_faults_are_parsed_and_bad_ones_refused_by_name():
    assert [str(f) for f in faults.parse_faults(["nan@3", "lr@5:10", "spike@7", "crash@9",
                                                 "spike@8:ngram"])] == [
        "nan@3", "lr@5:10", "spike@7:random", "crash@9", "spike@8:ngram"]
    for bad, words in [("boom@3", "KIND@STEP"), ("nan@0", "step >= 1"), ("nan3", "KIND@STEP"),
                       ("lr@5", "positive factor"), ("lr@5:-1", "positive factor"),
                       ("spike@5:zeros", "zeros"), ("crash@4:2", "takes no")]:
        with pytest.raises(spikes.SpikeError, match=words):
            faults.parse_faults([bad])
    with pytest.raises(spikes.SpikeError, match="given twice"):
        faults.parse_faults(["nan@3", "nan@3"])


def test_a_restart_fires_again_only_the_lr_faults_after_its_checkpoint(tmp_path):
    """The record of fired faults outlives a crash, so nan@, spike@ and crash@ fire once
    per run; an lr@ jump lives in state a checkpoint keeps, so a run resumed from a step
    before it (the checkpoint's factor predates the jump) fires it again at its step."""
    given = faults.parse_faults(["nan@12", "lr@15:10", "crash@18", "lr@5:2"])
    first = faults.FaultLog(given, tmp_path / faults.FAULTS_FILE)
    assert [str(f) for s in (5, 12, 15, 18) for f in first.due(s)] == [
        "lr@5:2", "nan@12", "lr@15:10", "crash@18"]
    resumed = faults.FaultLog(given, tmp_path / faults.FAULTS_FILE, resumed_from=10)
    assert [str(f) for s in range(1, 25) for f in resumed.due(s)] == ["lr@15:10"]
    later = faults.FaultLog(given, tmp_path / faults.FAULTS_FILE, resumed_from=16)
    assert [f for s in range(1, 25) for f in later.due(s)] == []


def test_window_limits_are_mean_plus_z_std_of_accepted_steps_after_warm_up():
    rng = np.random.default_rng(0)
    losses, norms = list(rng.normal(3, 0.1, 30)), list(rng.normal(1, 0.2, 30))
    w = spikes.Window(10, 4.0)
    for loss, norm in zip(losses[:9], norms[:9]):
        w.add(loss, norm)
    assert w.limits() == (math.inf, math.inf)  # warm-up: no decision before 10 values
    rebuilt = spikes.Window.rebuild(10, 4.0, losses, norms, rejected={29, 30})
    kept = np.array(list(zip(losses, norms))[18:28])  # steps 19..28; 29 and 30 rejected
    want = kept.mean(0) + 4.0 * kept.std(0)
    assert np.allclose(rebuilt.limits(), want, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------------------
# The guarded step, under every strategy
# --------------------------------------------------------------------------------------

def _step(name: str):
    plan = strategy_plan(name, 8, model_config.preset("tiny"))
    # test_checkpoint_resume's BASE schedule (8 steps, warm-up 2): the plain programs of
    # its every-strategy run are then in the compilation cache (the schedule's constants
    # are part of the program)
    _, params, optimizer = init_run(TrainConfig(model="tiny", steps=8, warmup=2))
    init, step = build_train_step(model_config.preset("tiny"), plan, optimizer,
                                  jax.devices()[:plan.n_devices])
    corpus = garden.make_corpus(0, 256, 16, model_config.preset("tiny").seq_len)
    batch = StepBatches(corpus.train, 32, model_config.preset("tiny").seq_len, 0).place(
        0, step.batch_sharding)
    return init(params), step, batch


@pytest.mark.slow
@pytest.mark.parametrize("name", STRATEGIES)
def test_a_nan_gradient_is_skipped_with_the_state_bitwise_unchanged(name):
    state, step, batch = _step(name)
    skipped, m = step(state, faults.poison(batch), steplib.Guard.make())
    assert not math.isfinite(float(m["loss"])) and not math.isfinite(float(m["grad_norm"]))
    assert not bool(m["accepted"]) and int(skipped.skipped) == int(state.skipped) + 1
    assert bits_equal(skipped._replace(skipped=state.skipped), state)
    if name not in ("single", "dp", "zero3", "3d"):
        return  # the plain programs of these four are compiled and compared below
    # a guard that accepts is the plain step, not a bit apart
    plain, _ = step(state, batch)
    accepted, m = step(state, batch, steplib.Guard.make(1e9, 1e9))
    assert bool(m["accepted"]) and bits_equal(accepted, plain)
    assert not bits_equal(plain, state)  # ... and that step did move the parameters


@pytest.mark.slow
def test_a_spike_above_the_limit_is_rejected_inside_the_step():
    state, step, batch = _step("single")
    _, m = step(state, batch)
    loss = float(m["loss"])
    _, low = step(state, batch, steplib.Guard.make(loss_max=loss - 1e-3))
    _, high = step(state, batch, steplib.Guard.make(loss_max=loss + 1e-3))
    assert not bool(low["accepted"]) and bool(high["accepted"])


# --------------------------------------------------------------------------------------
# The policies in the training loop
# --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_injected_faults_are_caught_at_their_steps_and_counted(tmp_path):
    logs = []
    r = train(RUN, progress=False, log=lambda m, k="warning": logs.append(m), out_dir=tmp_path,
              faults=faults.parse_faults(["spike@26", "nan@30", "spike@34:repeat"]))
    caught = {e["step"]: e for e in r.spike_events if e["event"] in ("spike", "nonfinite")}
    assert sorted(caught) == [26, 30, 34]
    assert caught[26]["event"] == caught[34]["event"] == "spike"
    assert caught[30]["event"] == "nonfinite"
    assert all(e["action"] == "skip" for e in caught.values())
    assert r.skipped_steps == 3 and r.steps_run == 40 and math.isfinite(r.val_loss)
    assert caught[26]["loss"] > caught[26]["loss_max"]
    assert any("step 26: spike" in m for m in logs)
    # the learning rate recorded is the one each update used: the schedule at the
    # optimizer's count, which a skipped update does not advance (3 behind at the end)
    schedule, before = lr_schedule(RUN), 0
    steps = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in steps if "batch" in x]
    for x in steps:
        assert x["lr"] == pytest.approx(float(schedule(x["step"] - 1 - before)), rel=1e-6), x
        before = x["skipped"]
    assert before == 3 and steps[-1]["lr"] != pytest.approx(float(schedule(39)), rel=1e-3)


@pytest.mark.slow
def test_stop_policy_stops_at_the_spike(tmp_path):
    r = train(replace(RUN, spike_policy="stop"), progress=False, out_dir=tmp_path,
              faults=faults.parse_faults(["spike@26"]))
    assert r.steps_run == 26 and r.skipped_steps == 1
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["step"] == 26 and lines[-1]["action"] == "stop"


@pytest.mark.slow
def test_rollback_restores_the_checkpoint_and_skips_exactly_the_reported_batches(
        tmp_path, monkeypatch):
    restored = []  # what the rollback restored (one device: from_canonical is the identity)
    real = C.Checkpointer.restore

    def spy(self, canonical, config):
        step, state, meta = real(self, canonical, config)
        restored.append(jax.device_get(state))
        return step, state, meta
    monkeypatch.setattr(C.Checkpointer, "restore", spy)
    cfg = replace(RUN, spike_policy="rollback", rollback_lr_factor=0.25)
    r = train(cfg, progress=False, out_dir=tmp_path / "out", faults=faults.parse_faults(
        ["spike@23"]), checkpoint=C.CheckpointOptions(str(tmp_path / "ck"), every=10, keep=None))
    rollback = next(e for e in r.spike_events if e["event"] == "rollback")
    assert rollback["to"] == 20 and rollback["skipped_batches"] == [20, 22]
    assert rollback["lr_factor"] == 0.25 and r.rollbacks == 1
    # the restored state is the step-20 checkpoint, tensor for tensor, bit for bit
    saved = tensors.read_canonical(tmp_path / "ck", 20)
    got = tensors.flat_items(restored[0])
    assert set(saved) == set(got) and all(
        np.asarray(got[k]).tobytes() == saved[k].tobytes() for k in saved)
    # before the rollback steps 21..23 read batches 20..22; after it no step reads them
    lines = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    at = next(i for i, x in enumerate(lines) if x.get("event") == "rollback")
    before = [x["batch"] for x in lines[:at] if "batch" in x and x["step"] > 20]
    after = [x["batch"] for x in lines[at:] if "batch" in x]
    assert before == [20, 21, 22] and after == list(range(23, 43))
    assert [x["step"] for x in lines[at:] if "batch" in x] == list(range(21, 41))
    assert r.steps_run == 40 and r.steps_computed == 43
    schedule = lr_schedule(cfg)  # the learning rate after the rollback: a quarter
    assert all(x["lr"] == pytest.approx(0.25 * float(schedule(x["step"] - 1)), rel=1e-6)
               for x in lines[at:] if "batch" in x)
    # the surviving curve up to step 20 is the straight run's
    straight = train(replace(RUN, spike_policy="none"), progress=False)
    assert r.loss_curve[:20] == straight.loss_curve[:20]


def test_bad_spike_and_restart_options_are_refused(capsys, tmp_path):
    def fails(argv, *words):
        with pytest.raises(SystemExit) as e:
            cli.main(["train", "--model", "tiny", "--steps", "5", "--out", str(tmp_path / "o"),
                      *argv])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert all(w in err for w in words), err
        assert not (tmp_path / "o").exists()

    fails(["--inject", "boom@3"], "boom@3", "nan, spike, lr, crash")
    fails(["--spike-policy", "rollback"], "--checkpoint-dir", "--spike-policy skip")
    fails(["--spike-policy", "sometimes"], "sometimes", "skip")
    fails(["--spike-window", "1"], "--spike-window")
    fails(["--max-restarts", "2"], "--max-restarts", "--checkpoint-dir")
    fails(["--rollback-lr-factor", "2"], "(0, 1]")


# --------------------------------------------------------------------------------------
# Restarts and elastic resumption
# --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_crashed_run_restarted_by_the_supervisor_ends_bit_identical(tmp_path):
    """The command line trains in a child process killed twice (SIGKILL) and restarted from
    its checkpoints; its last checkpoint equals an uninterrupted run's, bit for bit."""
    cfg = TrainConfig(model="tiny", steps=24, eval_every=12)  # the command line's corpus
    straight = train(cfg, progress=False,
                     checkpoint=C.CheckpointOptions(str(tmp_path / "a"), every=8))
    code = ("import sys; from jaxscale.cli.main import main; sys.exit(main(sys.argv[1:]))")
    crashed = run_python(
        code, "train", "--model", "tiny", "--steps", "24", "--eval-every", "12", "--json",
        "--checkpoint-dir", str(tmp_path / "b"), "--checkpoint-every", "8",
        "--out", str(tmp_path / "ob"), "--inject", "crash@11", "--inject", "crash@20",
        "--max-restarts", "3", timeout=600)
    assert crashed.returncode == 0, crashed.stderr[-2000:]
    assert crashed.stderr.count("killed by SIGKILL") >= 2, crashed.stderr[-2000:]
    a, b = tensors.read_canonical(tmp_path / "a", 24), tensors.read_canonical(tmp_path / "b", 24)
    assert set(a) == set(b) and all(a[k].tobytes() == b[k].tobytes() for k in a)
    fired = json.loads((tmp_path / "b" / faults.FAULTS_FILE).read_text())["fired"]
    assert sorted(fired) == ["crash@11", "crash@20"]
    result = json.loads((tmp_path / "ob" / "result.json").read_text())
    assert result["loss_curve"] == straight.loss_curve and result["resumed_from"] == 16


def test_elastic_micro_batches_keep_the_global_batch_or_name_what_can():
    assert elastic_micro_batches(Plan(dp=8), Plan(dp=4), 32) == 2
    assert elastic_micro_batches(Plan(dp=2, tp=2, pp=2, micro_batches=4, zero_stage=1),
                                 Plan(dp=4, zero_stage=1), 32) == 2
    assert elastic_micro_batches(Plan(dp=8), Plan(dp=6), 48) == 2
    with pytest.raises(PlanError, match=r"dp=6 cannot keep the global batch of 32 .* "
                                        r"dp sizes that can: 1, 2, 4, 8, 16, 32"):
        elastic_micro_batches(Plan(dp=8), Plan(dp=6), 32)


@pytest.mark.slow
@pytest.mark.parametrize("before, after", [
    ("dp=8", "dp=4"), ("dp=2,pp=2,tp=2", "dp=4 zero1"), ("dp=8 48", "dp=6 48")])
def test_resuming_on_fewer_devices_continues_the_curve(tmp_path, before, after):
    def cfg(spec):
        mesh, *rest = spec.split()
        c = replace(RUN, spike_policy="none", mesh=mesh, steps=16, eval_every=8,
                    batch_size=int(rest[-1]) if rest and rest[-1].isdigit() else 32)
        if "pp=2" in mesh:
            c = replace(c, micro_batches=4, zero_stage=1)
        if "zero1" in rest:
            c = replace(c, zero_stage=1)
        return c
    first = cfg(before)
    straight = train(first, progress=False,
                     checkpoint=C.CheckpointOptions(str(tmp_path / "straight"), every=8))
    d = str(tmp_path / "ck")  # the resumed run starts from a copy of its step-8 checkpoint
    shutil.copytree(tmp_path / "straight" / "8", tmp_path / "ck" / "8")
    second = cfg(after)
    saved = Plan(**store.read_meta(d, 8)["plan"])
    second = replace(second, micro_batches=elastic_micro_batches(
        saved, second.plan(validate=False), second.batch_size))
    resumed = train(second, progress=False, checkpoint=C.CheckpointOptions(d, resume=True))
    assert resumed.resumed_from == 8 and second.plan().n_devices < first.plan().n_devices
    a, b = np.array(straight.loss_curve), np.array(resumed.loss_curve)
    assert a[:8].tobytes() == b[:8].tobytes()
    assert np.max(np.abs(a - b) / np.abs(a)) <= 1e-5


@pytest.mark.slow
def test_resuming_onto_a_mesh_that_cannot_keep_the_batch_is_refused(capsys, tmp_path):
    d = tmp_path / "ck"
    train(replace(RUN, spike_policy="none", mesh="dp=8", steps=4), progress=False,
          checkpoint=C.CheckpointOptions(str(d), every=4))
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--model", "tiny", "--steps", "4", "--eval-every", "20",
                  "--warmup", "5", "--mesh", "dp=6", "--checkpoint-dir", str(d), "--resume",
                  "--out", str(tmp_path / "o")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "dp=6 cannot keep the global batch of 32" in err and "1, 2, 4, 8" in err, err

