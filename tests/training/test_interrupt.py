"""Ctrl-C while a checkpoint is being written: the save finishes, then the run stops.

    - SIGINT at each phase of a save (checkpoint/crash.py's `PHASE@N:INT`: as the save
      begins, while Orbax writes the step, after it commits), sync and async: the run stops
      right after that save with TrainInterrupted; the step is complete, nothing
      temporary is left, and a resumed run ends bit-identical to an uninterrupted one
    (20 Ctrl-Cs at random instants of real `jaxscale train` processes, with their
    interpreter shutdown, are benchmarks/ctrl_c.py's: results/ctrl_c.json)
    - the output folder never holds an earlier run's loss_curve.png beside a new result
"""
import functools
import json
import shlex
import signal
from dataclasses import replace

import pytest

from jaxscale.runtime.signals import interrupts_held
from jaxscale.training.checkpoint import crash, store
from jaxscale.training.checkpoint.manager import CheckpointOptions
from jaxscale.training.config import TrainConfig
from jaxscale.training.loop import train
from jaxscale.training.result import TrainInterrupted

CFG = TrainConfig(model="tiny", steps=12, eval_every=1000, warmup=2, n_train_docs=256,
                  n_val_docs=8)
EVERY = 2


@functools.lru_cache(maxsize=None)
def _straight(cfg=CFG):
    return train(cfg, progress=False).loss_curve


@pytest.fixture(autouse=True)
def ctrl_c_raises():
    """Ctrl-C as in a terminal (an xdist worker may have set SIGINT aside)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _leftovers(d) -> list[str]:
    return [p.name for p in d.iterdir() if store.TMP_MARK in p.name]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("phase", crash.PHASES)
@pytest.mark.slow
def test_ctrl_c_during_a_save_finishes_it_then_stops(tmp_path, monkeypatch, phase, async_save):
    d = tmp_path / "ck"
    monkeypatch.setenv(crash.ENV, f"{phase}@2:INT")  # the 2nd save: step 4
    with pytest.raises(TrainInterrupted) as e:
        train(CFG, progress=False, checkpoint=CheckpointOptions(
            str(d), every=EVERY, async_save=async_save))
    # stopped right after the save, or (async, where Orbax writes after the save returns)
    # as soon as the loop meets the signal; the step is complete either way
    assert e.value.result.steps_run == 2 * EVERY or (async_save
                                                     and e.value.result.steps_run > 2 * EVERY)
    saved = store.complete_steps(d)
    assert saved[:2] == [EVERY, 2 * EVERY] and not _leftovers(d)
    monkeypatch.delenv(crash.ENV)
    r = train(CFG, progress=False,
              checkpoint=CheckpointOptions(str(d), every=EVERY, resume=True))
    assert r.resumed_from == saved[-1] and r.loss_curve == _straight()


def test_a_ctrl_c_outside_the_block_is_untouched_and_inside_is_raised_after():
    got = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_held("the test", got.append):
            signal.raise_signal(signal.SIGINT)
            got.append("block finished")
    assert got == ["finishing the test before stopping", "block finished"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
    with interrupts_held("the test", got.append, reraise=False):  # close(): held, not raised
        signal.raise_signal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):  # nested: the inner adds nothing, the outer raises
        with interrupts_held("outer"):
            with interrupts_held("inner"):
                signal.raise_signal(signal.SIGINT)
            got.append("inner ended without raising")
    assert got[-1] == "inner ended without raising"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C the program ignores stays ignored
    with interrupts_held("the test"):
        signal.raise_signal(signal.SIGINT)


@pytest.mark.slow
def test_the_output_folder_holds_one_runs_files(tmp_path, monkeypatch):
    out = tmp_path / "out"
    train(replace(CFG, steps=4), out_dir=out, progress=False)
    assert (out / "loss_curve.png").exists()
    monkeypatch.setenv(crash.ENV, "written@1:INT")
    with pytest.raises(TrainInterrupted):
        train(replace(CFG, steps=4), out_dir=out, progress=False, checkpoint=CheckpointOptions(
            str(tmp_path / "ck"), every=EVERY))
    assert not (out / "loss_curve.png").exists()  # the old chart went with the old result
    assert json.loads((out / "result.json").read_text())["interrupted"] is True


@pytest.mark.slow
def test_the_cli_names_the_command_that_resumes(tmp_path, monkeypatch, capsys):
    """`jaxscale train` stopped by Ctrl-C inside a save: exit 130, no traceback, and a line
    with the exact command that resumes; that command, run, resumes from the saved step."""
    from jaxscale.cli.main import main

    argv = ["train", "--model", "tiny", "--steps", "6", "--eval-every", "1000",
            "--warmup", "2", "--train-docs", "256", "--checkpoint-dir", str(tmp_path / "ck"),
            "--checkpoint-every", "2", "--out", str(tmp_path / "out"), "--json"]
    monkeypatch.setenv(crash.ENV, "writing@1:INT")
    assert main(argv) == 130
    printed = capsys.readouterr()
    err = printed.err
    partial = json.loads(printed.out)  # --json: the steps that ran, marked interrupted
    assert partial["interrupted"] is True and partial["steps_run"] == 2
    assert "Traceback" not in err and "finishing the checkpoint of step 2" in err, err
    line = next(ln for ln in err.splitlines() if "resume with:" in ln)
    command = shlex.split(line.split("resume with: ", 1)[1])
    assert command == ["jaxscale", *argv, "--resume"]
    monkeypatch.delenv(crash.ENV)
    assert main(command[1:]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["resumed_from"] == 2


def test_an_interrupted_compare_leaves_no_earlier_report_beside_its_json(
        tmp_path, monkeypatch, capsys):
    from jaxscale.cli.main import main
    from jaxscale.compare import run as compare_run

    out = tmp_path / "compare"
    out.mkdir()
    for old in ("compare.md", "memory.png", "losses.png", "notes.txt"):
        (out / old).write_text("an earlier run's")

    def interrupted(*args, **kw):
        raise KeyboardInterrupt
    monkeypatch.setattr(compare_run, "run_all", interrupted)
    assert main(["compare", "--out", str(out), "--strategies", "single,dp"]) == 130
    # this run's options (written as its work starts) beside its JSON, no earlier report
    assert sorted(p.name for p in out.iterdir()) == ["compare.json", "config.toml", "notes.txt"]
    assert json.loads((out / "compare.json").read_text())["complete"] is False
    capsys.readouterr()
