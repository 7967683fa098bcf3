"""The `jaxscale` command: bad input is one clear line and exit code 2; a real run end to end."""
import json

import pytest

from jaxscale.cli import main
from jaxscale.model import param_count, preset

from conftest import run_python


def _fail(capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("argv, words", [
    (["train", "--model", "huge"], ["'huge'", "tiny", "small"]),
    (["train", "--steps", "-5"], ["--steps", "-5"]),
    (["train", "--steps", "ten"], ["--steps", "'ten'"]),
    (["train", "--lr", "0"], ["--lr", "0"]),
    (["train", "--optimizer", "lion"], ["'lion'", "adamw", "sgd"]),
    (["train", "--devices", "0"], ["--devices", "0"]),
    (["train", "--mesh", "dp=2,xp=4"], ["'xp'", "dp, pp, tp"]),
    (["train", "--mesh", "dp=4"], ["dp=4", "needs 4 devices but 8"]),
    (["train", "--mesh", "dp=3"], ["32 documents", "dp x micro_batches = 3 x 1"]),
    (["train", "--mesh", "dp=0"], ["dp", "got 0"]),
    (["train", "--devices", "4"], ["asked for 4 CPU devices", "already started with 8"]),
    (["train", "--zero", "5"], ["--zero", "5", "0, 1, 2, 3"]),
    (["train", "--zero", "1"], ["ZeRO needs dp > 1"]),
    (["train", "--mesh", "dp=2,tp=2,pp=2", "--zero", "2"], ["ZeRO stage 2",
                                                             "only zero_stage=1"]),
    (["train", "--mesh", "tp=8"], ["tp=8", "heads (4)", "[1, 2, 4]"]),
    (["train", "--mesh", "dp=2,pp=4"], ["pp x virtual = 4 x 1", "2 layers"]),
    (["train", "--mesh", "dp=2,pp=2,tp=2", "--micro-batches", "3"], ["32 documents", "2 x 3"]),
    (["train", "--mesh", "pp=2,dp=4", "--schedule", "interleaved", "--micro-batches", "1"],
     ["multiple of the stages", "m=1"]),
    (["train", "--micro-batches", "0"], ["--micro-batches", "got 0"]),
    (["train", "--schedule", "zigzag"], ["'zigzag'", "'gpipe', '1f1b', 'interleaved'"]),
    (["train", "--precision", "fp64"], ["'fp64'", "bf16", "fp16", "bf16-pure"]),
    (["train", "--model", "7b"], ["7b", "only built abstractly"]),
    (["fly"], ["'fly'", "train"]),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, words):
    err = _fail(capsys, argv)
    for w in words:
        assert w in err, err


def test_help_explains_the_options(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for flag in ["--model", "--steps", "--optimizer", "--lr", "--seed", "--out", "--json",
                 "--devices", "--mesh", "--zero", "--micro-batches", "--schedule", "--remat",
                 "--precision", "entropy floor"]:
        assert flag in out


def test_train_end_to_end_json(tmp_path):
    """`python -m jaxscale train ... --json` in a fresh process, forcing one CPU device."""
    r = run_python("from jaxscale.cli import main; import sys; sys.exit(main(sys.argv[1:]))",
                   "train", "--steps", "40", "--eval-every", "20", "--devices", "1",
                   "--mesh", "dp=1", "--json", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["loss_curve"]) == 40 and out["steps_run"] == 40
    assert out["val_loss"] > out["entropy_floor"] > 0.5
    assert out["param_count"] == param_count(preset("tiny"))
    assert {"grad_norms", "gap", "tokens_per_s", "compile_s"} <= out.keys()
    assert (tmp_path / "loss_curve.png").exists() and (tmp_path / "metrics.jsonl").exists()


def test_train_data_parallel_in_process(capsys, tmp_path):
    """8 forced devices are already up in this process: dp=8 with 2 micro-batches."""
    assert main(["train", "--devices", "8", "--mesh", "dp=8", "--micro-batches", "2",
                 "--steps", "4", "--eval-every", "4", "--json", "--out", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["mesh"] == "dp=8" and out["config"]["micro_batches"] == 2
    assert len(out["loss_curve"]) == 4 and out["loss_curve"][-1] < out["loss_curve"][0]


def test_data_parallel_bad_input(capsys):
    err = _fail(capsys, ["train", "--devices", "8", "--mesh", "dp=8", "--batch-size", "12"])
    assert "12 documents is not divisible by dp x micro_batches = 8 x 1" in err
    err = _fail(capsys, ["train", "--mesh", "dp=4,tp=2", "--precision", "fp16", "--zero", "2"])
    assert "ZeRO stage 2" in err and "with tp=2, pp=1 only zero_stage=1" in err
