"""The `jaxscale` command: bad input is one clear line and exit code 2; a real run end to
end; a diverged run exits 1, Ctrl-C exits 130 with what ran saved; --version; the test
suite's compilation cache is never re-pointed at the user's home."""
import json
from importlib import metadata

import jax
import pytest

from jaxscale.training import setup as train_setup
from jaxscale.runtime.compile_cache import enable_compilation_cache
from jaxscale.cli.main import main
from jaxscale.model.config import param_count, preset

from conftest import CACHE, run_python


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
    (["train", "--mesh", "dp=2,xp=4"], ["'xp'", "dp, ep, pp, cp, tp"]),
    (["train", "--mesh", "dp=2,dp=4"], ["'dp' given twice"]),
    (["train", "--mesh", "dp=8", "--sequence-parallel"], ["sequence parallelism", "tp=1"]),
    (["train", "--mesh", "dp=2,pp=2,cp=2", "--micro-batches", "2"], ["cp=2", "pp=2",
                                                                       "use pp=1"]),
    (["train", "--mesh", "dp=4"], ["dp=4", "needs 4 devices but 8"]),
    (["train", "--mesh", "dp=3"], ["32 documents", "dp x micro_batches = 3 x 1"]),
    (["train", "--mesh", "dp=0"], ["dp", "got 0"]),
    (["train", "--devices", "4"], ["asked for 4 CPU devices", "already started with 8"]),
    (["train", "--zero", "5"], ["--zero", "5", "0, 1, 2, 3"]),
    (["train", "--zero", "1"], ["ZeRO needs dp > 1"]),
    (["train", "--mesh", "tp=8"], ["tp=8", "heads (4)", "[1, 2, 4]"]),
    (["train", "--mesh", "dp=2,pp=4"], ["pp x virtual = 4 x 1", "2 layers"]),
    (["train", "--mesh", "dp=2,pp=2,tp=2", "--micro-batches", "3"], ["32 documents", "2 x 3"]),
    (["train", "--mesh", "pp=2,dp=4", "--schedule", "interleaved", "--micro-batches", "1"],
     ["multiple of the stages", "m=1"]),
    (["train", "--micro-batches", "0"], ["--micro-batches", "got 0"]),
    (["train", "--schedule", "zigzag"], ["'zigzag'", "'gpipe', '1f1b', 'interleaved'"]),
    (["train", "--precision", "fp64"], ["'fp64'", "bf16", "fp16", "bf16-pure"]),
    (["train", "--model", "7b"], ["'7b' is sized for GPU/TPU", "tiny, tiny8, small"]),
    (["train", "--platform", "tpu"], ["--platform tpu: no tpu devices here"]),
    (["train", "--attention", "cudnn"], ["--attention cudnn: cuDNN flash attention runs on "
                                          "NVIDIA GPUs; these devices are cpu"]),
    (["train", "--attention", "flash"], ["'flash'", "einsum", "xla", "cudnn"]),
    (["train", "--mesh", "dp=16"], ["dp=16", "16 devices", "8"]),
    (["train", "--steps", "-1e3"], ["--steps", "got -1e3"]),  # not "expected one argument"
    (["train", "--lr", "-1e-3"], ["--lr", "> 0", "-1e-3"]),
    (["train", "--lr", "nan"], ["--lr", "got nan"]),
    (["train", "--steps", "1e16"], ["--steps", "at most 1e15"]),
    (["train", "--steps", "2.5"], ["--steps", "integer", "'2.5'"]),
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


@pytest.mark.slow
def test_train_end_to_end_json(tmp_path):
    """`python -m jaxscale train ... --json` in a fresh process, forcing one CPU device, with
    HOME an empty folder: nothing may be written there (caches stay in the repository)."""
    home = tmp_path / "home"
    home.mkdir()
    out_dir = tmp_path / "out"
    r = run_python("from jaxscale.cli.main import main; import sys; sys.exit(main(sys.argv[1:]))",
                   "train", "--steps", "40", "--eval-every", "20", "--devices", "1",
                   "--mesh", "dp=1", "--json", "--out", str(out_dir), env={"HOME": str(home)})
    assert r.returncode == 0, r.stderr
    assert not list(home.rglob("*")), list(home.rglob("*"))
    tmp_path = out_dir
    out = json.loads(r.stdout)
    assert len(out["loss_curve"]) == 40 and out["steps_run"] == 40
    assert out["val_loss"] > out["entropy_floor"] > 0.5
    assert out["param_count"] == param_count(preset("tiny"))
    assert {"grad_norms", "gap", "tokens_per_s", "compile_s"} <= out.keys()
    assert (tmp_path / "loss_curve.png").exists() and (tmp_path / "metrics.jsonl").exists()


@pytest.mark.slow
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
    err = _fail(capsys, ["train", "--mesh", "dp=4,pp=2", "--precision", "fp16",
                         "--sequence-parallel", "--micro-batches", "2"])
    assert "sequence parallelism splits the sequence over the tensor-parallel" in err


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"jaxscale {metadata.version('jaxscale')} ")
    assert f"jax {jax.__version__}" in out and f"jaxlib {metadata.version('jaxlib')}" in out


def test_train_out_is_checked_before_any_work(capsys, tmp_path):
    (tmp_path / "file").write_text("x")
    err = _fail(capsys, ["train", "--out", str(tmp_path / "file")])
    assert "is an existing file, not a folder" in err
    err = _fail(capsys, ["train", "--out", str(tmp_path / "file" / "sub")])
    assert "is a file" in err


# One short run that diverges (SGD at lr 1e4 gives NaN at step 4), shared by the next tests
# so that they compile one program.
DIVERGING = ["train", "--steps", "8", "--optimizer", "sgd", "--lr", "1e4", "--warmup", "0",
             "--eval-every", "100"]


@pytest.mark.slow
def test_nan_loss_exits_1_with_one_line(capsys, tmp_path):
    assert main([*DIVERGING, "--json", "--out", str(tmp_path)]) == 1
    out = capsys.readouterr()
    result = json.loads(out.out)  # strict JSON: NaN became null
    assert result["nonfinite_step"] == 4 and result["loss_curve"][-1] is None
    assert result["steps_run"] == 4  # stopped at the NaN, not run to the end
    err = [line for line in out.err.splitlines() if line.startswith("jaxscale: error:")]
    assert len(err) == 1 and "at step 4" in err[0] and "lower --lr (now 10000" in err[0], out.err
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[-1])["loss"] is None
    assert json.loads((tmp_path / "result.json").read_text())["nonfinite_step"] == 4
    # the CLI kept the suite's compilation cache (it used to re-point it to ~/.cache)
    assert jax.config.jax_compilation_cache_dir == str(CACHE)


@pytest.mark.slow
def test_ctrl_c_saves_what_ran_and_exits_130(capsys, tmp_path, monkeypatch):
    class CtrlCAtStep2(train_setup.Progress):
        def update(self, step, info):
            if step == 2:
                raise KeyboardInterrupt
            super().update(step, info)

    monkeypatch.setattr(train_setup, "Progress", CtrlCAtStep2)
    assert main([*DIVERGING, "--out", str(tmp_path)]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and "interrupted after 2 steps of 8" in err, err
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["interrupted"] is True and saved["steps_run"] == 2
    assert [json.loads(x)["step"] for x in
            (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]  # flushed


def test_ctrl_c_elsewhere_is_one_line_and_130(capsys, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr("jaxscale.cli.commands.memory.run", interrupted)
    assert main(["memory", "--params", "7e9"]) == 130
    assert capsys.readouterr().err.strip() == "jaxscale: interrupted"


def test_compilation_cache_keeps_a_dir_already_chosen(monkeypatch, tmp_path):
    assert jax.config.jax_compilation_cache_dir == str(CACHE)
    monkeypatch.delenv("JAXSCALE_CACHE_DIR")  # without it the default was ~/.cache/jaxscale
    enable_compilation_cache()
    assert jax.config.jax_compilation_cache_dir == str(CACHE)
    monkeypatch.setenv("JAXSCALE_CACHE_DIR", "off")
    enable_compilation_cache()
    assert jax.config.jax_compilation_cache_dir == str(CACHE)


def test_the_precision_options_reach_the_train_config():
    """A flag parsed but dropped on the way to the TrainConfig would train something else
    (it happened: --optimizer-state-dtype was parsed and written to config.toml, and the
    run kept fp32 moments)."""
    from jaxscale.cli.commands.train import _config
    from jaxscale.cli.main import build_parser
    args = build_parser().parse_args(["train", "--optimizer-state-dtype", "bf16",
                                      "--precision", "fp8", "--optimizer", "adam"])
    cfg = _config(args)
    assert (cfg.optimizer_state_dtype, cfg.precision, cfg.optimizer) == ("bf16", "fp8", "adam")
