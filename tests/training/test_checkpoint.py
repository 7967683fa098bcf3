"""Checkpoints: the canonical form of every layout, lossless save and restore across plans,
damaged checkpoints, and bad input (jaxscale.training.checkpoint.manager, jaxscale.parallel.canonical).

The resume-in-a-new-process and crash tests are in test_checkpoint_resume.py."""
import functools
import json
import shutil
from dataclasses import asdict, replace

import jax
import numpy as np
import pytest

from jaxscale.training.checkpoint import manager as C
from jaxscale.training.checkpoint import store, tensors
from jaxscale.training.checkpoint.meta import run_meta
from jaxscale.cli import main as cli
from jaxscale.parallel.plan import Plan
from jaxscale.parallel.build import build_train_step
from jaxscale.training.config import TrainConfig
from jaxscale.training.reference import init_run
from jaxscale.training.loop import train
from jaxscale.model import config as model_config

# tiny8: 8 layers and 8 heads, so that tp, pp, 3-D and the interleaved order all fit
MODEL = "tiny8"
LAYOUTS = {
    "dp=4": Plan(dp=4),
    "zero1 dp=2": Plan(dp=2, zero_stage=1, micro_batches=2),
    "zero3 dp=8": Plan(dp=8, zero_stage=3),
    "tp=4": Plan(tp=4),
    "tp=2,pp=2": Plan(tp=2, pp=2, micro_batches=4),
    "3d zero1": Plan(dp=2, tp=2, pp=2, micro_batches=4, zero_stage=1),
    "interleaved": Plan(pp=2, micro_batches=4, schedule="interleaved", virtual=2),
}


@functools.lru_cache(maxsize=None)
def built(plan: Plan, precision: str = "fp32"):
    """(init, step, params) of a plan: one compiled set per plan for the whole module.
    The schedule (8 steps, warm-up 2) is test_checkpoint_resume's, so that the programs
    its runs under the same plans compile come from the compilation cache (the schedule's
    constants are part of a program); no test here depends on the learning rate."""
    cfg = TrainConfig(model=MODEL, precision=precision, steps=8, warmup=2)
    _, params, optimizer = init_run(cfg)
    plan = replace(plan, precision=precision)
    init, step = build_train_step(model_config.preset(MODEL), plan, optimizer, jax.devices()[:plan.n_devices])
    return init, step, params


def max_diff(a, b) -> float:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    return max((float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
                for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)) if np.size(x)),
               default=0.0)


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.slow
def test_every_layout_converts_to_the_single_device_state_and_back_exactly(name):
    """to_canonical of a plan's fresh state IS Plan()'s state (max abs diff 0.0), and
    from_canonical gives the plan's own state back bit for bit. A fresh state's Adam moments
    are all zero, where a slice or a layer put in the wrong place would not show: so also
    one step in, the canonical moments equal one device's within rounding (1e-6 absolute;
    the moments are (1-b) x gradients of at most ~1, whose sums differ in order by ~1e-8),
    and the round trip stays exact."""
    init, step, params = built(LAYOUTS[name])
    ref = built(Plan())[0](params)
    state = init(params)
    canonical = step.canonical.to_canonical(state)
    assert max_diff(canonical, ref) == 0.0
    assert max_diff(step.canonical.from_canonical(canonical), state) == 0.0
    # the canonical tensors stay sharded: no device holds a whole block matrix
    w1 = canonical.opt_state.mu["blocks"]["w1"]
    assert max(s.data.size for s in w1.addressable_shards) < w1.size
    state, step = _trained(LAYOUTS[name], 1)
    ref, _ = _trained(Plan(), 1)
    canonical = step.canonical.to_canonical(state)
    moments = (canonical.opt_state.mu, canonical.opt_state.nu)
    assert max_diff(moments, (ref.opt_state.mu, ref.opt_state.nu)) <= 1e-6
    assert max(float(np.max(np.abs(x))) for x in jax.tree.leaves(canonical.opt_state.mu)) > 1e-3
    assert max_diff(step.canonical.from_canonical(canonical), state) == 0.0


@pytest.mark.slow
def test_master_weights_and_loss_scale_are_part_of_the_canonical_state():
    init, step, params = built(Plan(dp=8, zero_stage=3), "fp16")
    ref = built(Plan(), "fp16")[0](params)
    canonical = step.canonical.to_canonical(init(params))
    assert canonical.master is not None and float(canonical.loss_scale) == 2.0**15
    assert canonical.params["tok_embed"].dtype == np.float16
    assert max_diff(canonical, ref) == 0.0


def _trained(plan: Plan, steps: int = 2):
    """A plan's state after `steps` real steps (so that Adam's moments are not zero)."""
    from jaxscale import garden
    from jaxscale.data.sampler import StepBatches

    init, step, params = built(plan)
    batches = StepBatches(garden.make_corpus(0, 256, 8, 64).train, 32, 64, seed=0)
    state = init(params)
    for s in range(steps):
        state, _ = step(state, batches.place(s, step.batch_sharding))
    return state, step


SOURCES = ("zero3 dp=8", "3d zero1", "tp=4")
TARGETS = ("single", "dp=4", "zero1 dp=2", "tp=2,pp=2", "interleaved")


def _plan(name):
    return Plan() if name == "single" else LAYOUTS[name]


@pytest.mark.slow
@pytest.mark.parametrize("source", SOURCES)
def test_restore_into_another_plan_is_lossless(source, tmp_path):
    """Saved from one plan, restored into five others: the restored canonical state equals
    the saved one bit for bit, and so does the state laid out for the new plan."""
    state, step = _trained(LAYOUTS[source])
    saved = step.canonical.to_canonical(state)
    cfg = TrainConfig(model=MODEL)
    options = C.CheckpointOptions(str(tmp_path / "ck"), every=1)
    with C.Checkpointer(options) as ckpt:
        ckpt.save(2, saved, run_meta(cfg, LAYOUTS[source], 64, [1.0, 1.0], [1.0, 1.0],
                                             [], 100))
    for target in TARGETS:
        _, other = _trained(_plan(target), steps=0)
        with C.Checkpointer(replace(options, every=None, resume=True)) as ckpt:
            at, restored, meta = ckpt.restore(other.canonical, asdict(cfg))
        assert at == 2 and meta["plan_layout"] == LAYOUTS[source].layout()
        assert max_diff(restored, saved) == 0.0, target
        laid_out = other.canonical.from_canonical(restored)
        assert max_diff(other.canonical.to_canonical(laid_out), saved) == 0.0, target


# --------------------------------------------------------------------------------------
# train(): halting, resuming, damaged checkpoints (one device, the tiny model)
# --------------------------------------------------------------------------------------

TINY = TrainConfig(model="tiny", steps=8, eval_every=4, n_train_docs=256, n_val_docs=16)


def _train(tmp_path, name, resume=False, halt_after=None, every=2, cfg=TINY, **kw):
    options = C.CheckpointOptions(str(tmp_path / name), every=every, resume=resume, **kw)
    notes = []
    result = train(cfg, out_dir=tmp_path / f"out-{name}", progress=False,
                   log=lambda msg, kind="warning": notes.append(msg), checkpoint=options,
                   halt_after=halt_after)
    return result, notes


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run, checkpointed every 2 steps."""
    tmp = tmp_path_factory.mktemp("straight")
    return _train(tmp, "ck")[0], tmp / "ck"


@pytest.mark.slow
def test_halt_then_resume_in_process_is_bit_identical(straight, tmp_path):
    full, _ = straight
    half, _ = _train(tmp_path, "ck", halt_after=4)
    assert half.halted and half.steps_run == 4 and len(half.val_curve) == 1
    rest, notes = _train(tmp_path, "ck", resume=True)
    assert rest.resumed_from == 4 and any("resumed from" in n for n in notes)
    assert rest.loss_curve == full.loss_curve  # every step, bit for bit
    assert rest.val_curve == full.val_curve and rest.tokens_seen == full.tokens_seen
    a, b = tensors.read_canonical(tmp_path / "ck", 8), tensors.read_canonical(straight[1], 8)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    lines = (tmp_path / "out-ck" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == list(range(1, 9))


@pytest.mark.slow
def test_an_async_save_in_flight_is_finished_at_exit(tmp_path, monkeypatch):
    """Ctrl-C right after an asynchronous save started: train stops, and the save is
    complete (and resumable) by the time the KeyboardInterrupt reaches the caller."""
    from jaxscale.training import setup as train_setup
    from jaxscale.training.result import TrainInterrupted

    update = train_setup.Progress.update

    def interrupt_at_5(self, step, info):
        if step == 5:
            raise KeyboardInterrupt
        return update(self, step, info)
    monkeypatch.setattr(train_setup.Progress, "update", interrupt_at_5)
    with pytest.raises(TrainInterrupted):
        _train(tmp_path, "ck", every=4, async_save=True)
    assert store.complete_steps(tmp_path / "ck") == [4]
    assert not [r for r in store.listing(tmp_path / "ck") if not r["complete"]]


@pytest.mark.slow
def test_keep_deletes_the_oldest(straight):
    assert store.complete_steps(straight[1]) == [4, 6, 8]  # keep=3 of 2, 4, 6, 8
    # deleted by a rename into the trash, which is emptied after each save
    assert not list((straight[1] / store.TRASH).iterdir())


def test_a_half_deleted_step_in_the_trash_is_never_listed_and_is_removed(straight, tmp_path):
    """A kill while an old step is being removed leaves part of it in the trash only:
    the listing never shows it, and the next run that opens the directory removes it."""
    d = tmp_path / "ck"
    shutil.copytree(straight[1], d)
    shutil.copytree(d / "4", d / store.TRASH / "2")
    shutil.rmtree(d / store.TRASH / "2" / "state")  # half deleted
    assert [r["step"] for r in store.listing(d)] == [4, 6, 8]
    assert all(r["complete"] for r in store.listing(d))
    C.Checkpointer(C.CheckpointOptions(str(d), every=2, resume=True)).close()
    assert not list((d / store.TRASH).iterdir()) and store.complete_steps(d) == [4, 6, 8]


def _damage(step_dir, how):
    target = max((p for p in (step_dir / "state").rglob("*") if p.is_file()),
                 key=lambda p: p.stat().st_size)  # the largest: array data
    if how == "delete":
        target.unlink()
    else:
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    return target


@pytest.mark.parametrize("how", ["delete", "truncate"])
def test_a_damaged_checkpoint_is_named_and_the_previous_one_used(straight, tmp_path, how):
    shutil.copytree(straight[1], tmp_path / "ck")
    _damage(tmp_path / "ck" / "8", how)
    _damage(tmp_path / "ck" / "6", how)
    # reading only (truncate); saving again (delete): the damaged steps are moved aside
    saving = how == "delete"
    rest, notes = _train(tmp_path, "ck", resume=True, every=2 if saving else None)
    assert rest.resumed_from == 4
    damaged = [n for n in notes if "is damaged" in n]
    assert len(damaged) == 2 and str(tmp_path / "ck" / "8") in damaged[0]
    assert ("is missing" if saving else "when saved") in damaged[0]
    assert "falling back to step 6" in damaged[0] and "falling back to step 4" in damaged[1]
    assert rest.loss_curve == straight[0].loss_curve
    if saving:
        assert all("moved aside" in n for n in damaged)
        assert (tmp_path / "ck" / "8.damaged").is_dir()
        assert store.complete_steps(tmp_path / "ck") == [4, 6, 8]  # saved again, whole


def test_resume_refuses_another_runs_checkpoint(straight, tmp_path):
    other = replace(TINY, lr=TINY.lr / 2)
    with pytest.raises(store.CheckpointError, match=r"lr=0.01 but this run has lr=0.005.*"
                                                r"--accept-lr-change"):
        train(other, progress=False, checkpoint=C.CheckpointOptions(str(straight[1]),
                                                                    resume=True))
    result = train(other, progress=False, checkpoint=C.CheckpointOptions(
        str(straight[1]), resume=True, accept_lr_change=True))
    assert result.resumed_from == 8 and result.steps_run == 8


# --------------------------------------------------------------------------------------
# Bad input on the command line: one line, exit 2, nothing written
# --------------------------------------------------------------------------------------

def _fails(capsys, argv, *words):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("jaxscale: error:"), err
    for w in words:
        assert w in err, err
    return err


def test_bad_checkpoint_input(capsys, tmp_path, straight):
    out = tmp_path / "out"
    base = ["train", "--model", "tiny", "--steps", "8", "--out", str(out)]
    _fails(capsys, base + ["--checkpoint-dir", str(tmp_path / "none"), "--resume"],
           "does not exist")
    (tmp_path / "empty").mkdir()
    _fails(capsys, base + ["--checkpoint-dir", str(tmp_path / "empty"), "--resume"],
           "holds no complete checkpoint")
    _fails(capsys, ["train", "--model", "small", "--steps", "8", "--out", str(out),
                    "--checkpoint-dir", str(straight[1]), "--resume"],
           "model='tiny'", "--model tiny")
    (tmp_path / "file").write_text("x")
    _fails(capsys, base + ["--checkpoint-dir", str(tmp_path / "file"), "--checkpoint-every",
                           "2"], "is an existing file, not a folder")
    _fails(capsys, base + ["--checkpoint-dir", "/proc/self/ckpt", "--checkpoint-every", "2"],
           "cannot write into '/proc/self'")
    _fails(capsys, base + ["--checkpoint-dir", str(straight[1]), "--checkpoint-every", "2"],
           "already holds checkpoints", "--resume")
    _fails(capsys, base + ["--resume", "--keep", "2"], "--resume, --keep need --checkpoint-dir")
    _fails(capsys, base + ["--checkpoint-dir", str(straight[1]), "--resume",
                           "--async-checkpoint"], "--async-checkpoint only apply when saving")
    _fails(capsys, base + ["--checkpoint-dir", str(tmp_path / "a"), "--checkpoint-every", "2",
                           "--accept-lr-change"], "only applies with --resume")
    _fails(capsys, base + ["--checkpoint-dir", str(tmp_path / "a")], "--checkpoint-every")
    _fails(capsys, base + ["--halt-after", "8"], "must be below --steps")
    _fails(capsys, base + ["--checkpoint-dir", str(tmp_path / "a"), "--checkpoint-every", "0"],
           "--checkpoint-every", "must be")
    assert not out.exists() and not (tmp_path / "a").exists() and not (tmp_path / "none").exists()


def test_checkpoint_ls(capsys, straight, tmp_path):
    shutil.copytree(straight[1], tmp_path / "ck")
    shutil.copytree(tmp_path / "ck" / "8", tmp_path / "ck" / ("10" + store.TMP_MARK))
    assert cli.main(["checkpoint", "ls", str(tmp_path / "ck"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["checkpoints"]
    assert [(r["step"], r["complete"]) for r in rows] == [(4, True), (6, True), (8, True),
                                                          (10, False)]
    assert rows[0]["plan"] == "dp=1" and rows[0]["samples_seen"] == 4 * TINY.batch_size
    assert all(r["bytes"] > 0 for r in rows)
    assert cli.main(["checkpoint", "ls", str(tmp_path / "ck")]) == 0
    assert "incomplete" in capsys.readouterr().out


def test_a_small_replicated_tensor_is_saved_without_slicing_it(tmp_path):
    """Orbax would cut a tensor held whole by 4 devices into 4 slices along a dimension 4
    divides, one per replica, each an eager slice on its device (a program each, compiled
    on first sight: 5 programs with the digests). Under tensors.REPLICA_SLICE_MIN_BYTES one
    replica writes it whole: one program, the digests, and it reads back whole."""
    from conftest import COMPILES
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:4]), ("dp",))
    x = jax.device_put(np.arange(8 * 41, dtype=np.float32).reshape(8, 41),  # a shape of its own
                       NamedSharding(mesh, PartitionSpec()))
    before = COMPILES["compile_requests"]  # programs compiled or loaded from the cache
    with C.Checkpointer(C.CheckpointOptions(str(tmp_path), every=1)) as ckpt:
        ckpt.save(1, {"x": x}, {})
    assert COMPILES["compile_requests"] - before == 1
    assert np.array_equal(tensors.read_canonical(tmp_path, 1)["x"], np.asarray(x))
