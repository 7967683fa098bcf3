"""`--config FILE.toml` for train and compare: keys are the options, the command line wins,
bad keys and values are named with their line, and a run's config.toml repeats it."""
import json

import pytest

from jaxscale.cli import config_file
from jaxscale.cli.main import build_parser, main


def _sub(name):
    parser = build_parser()
    return parser, next(a for a in parser._actions if hasattr(a, "choices")
                        and isinstance(a.choices, dict)).choices[name]


def test_the_file_sets_options_and_the_command_line_wins(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('model = "tiny8"\nsteps = 7\nbatch-size = 16\nstrategy = ["dp=2", "tp=2"]\n'
                 "json = true\n")
    _, compare = _sub("compare")
    args = config_file.reparse(compare, ["--steps", "9"], str(f))
    assert (args.model, args.steps, args.batch_size, args.json) == ("tiny8", 9, 16, True)
    assert args.strategy == ["dp=2", "tp=2"]
    _, compare = _sub("compare")  # a repeatable option on the line replaces the file's list
    args = config_file.reparse(compare, ["--strategy", "pp=2"], str(f))
    assert args.strategy == ["pp=2"]
    f.write_text("batch_size = 8\n")  # the underscore spelling too
    _, train = _sub("train")
    assert config_file.reparse(train, [], str(f)).batch_size == 8


@pytest.mark.parametrize("text, words", [
    ('model = "tiny"\nstpes = 3\n', ["line 2", "unknown key 'stpes'", "steps"]),
    ("steps = 0\n", ["line 1", "steps = 0", "got 0"]),
    ('steps = "many"\n', ["line 1", 'steps = "many"']),
    ("json = 1\n", ["line 1", "a flag takes true or false"]),
    ('model = ["tiny"]\n', ["line 1", "takes one value"]),
    ('platform = "quantum"\n', ["line 1", "choose from auto, cpu"]),
    ("steps = \n", ["is not TOML"]),
])
def test_bad_files_are_one_line_naming_key_and_line(capsys, tmp_path, text, words):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(SystemExit) as e:
        main(["compare", "--config", str(f)])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    assert all(w in err for w in words), err


def test_a_file_that_is_not_utf8_is_one_line(capsys, tmp_path):
    f = tmp_path / "latin1.toml"
    f.write_bytes('out = "café"\n'.encode("latin-1"))  # TOML is UTF-8 whatever the locale
    with pytest.raises(SystemExit) as e:
        main(["train", "--config", str(f)])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "not UTF-8" in err, err


def test_a_missing_file_is_refused(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["train", "--config", str(tmp_path / "none.toml")])
    assert "cannot read the config" in capsys.readouterr().err


@pytest.mark.slow
def test_a_runs_config_toml_repeats_it(cli, tmp_path):
    first = cli("compare", "--strategies", "dp", "--steps", "2", "--repeats", "3", "--out",
                str(tmp_path / "a"), "--json")
    written = (tmp_path / "a" / "config.toml").read_text()
    assert 'strategies = "dp"' in written and "steps = 2" in written
    assert "json = true" in written  # so the repeat prints JSON too
    second = cli("compare", "--config", str(tmp_path / "a" / "config.toml"), "--out",
                 str(tmp_path / "b"), "--json")
    assert [r["name"] for r in second["rows"]] == [r["name"] for r in first["rows"]]
    assert second["steps"] == 2 and second["rows"][2]["losses"] == first["rows"][2]["losses"]


def test_prefixes_dates_and_any_text(capsys, tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('inject = ["nan@3"]\nout = "runs/\U0001f600 ünï"\n')
    _, train = _sub("train")
    args = config_file.reparse(train, ["--inj", "nan@5"], str(f))  # a prefix replaces too
    assert args.inject == ["nan@5"] and str(args.out).endswith("\U0001f600 ünï")
    written = config_file.write(train, args, tmp_path / "w").read_text()
    import tomllib
    back = tomllib.loads(written)  # the emoji and the accents are read back as written
    assert back["out"].endswith("\U0001f600 ünï") and back["inject"] == ["nan@5"]
    assert "resume" not in back and "halt-after" not in back
    f.write_text("steps = 1979-05-27\n")
    with pytest.raises(SystemExit):
        main(["train", "--config", str(f)])
    err = capsys.readouterr().err
    assert "line 1" in err and "takes a number, a string" in err and "Traceback" not in err


@pytest.mark.parametrize("given, kept", [
    (("--checkpoint-dir", "ck", "--resume", "--accept-lr-change"), False),
    (("--checkpoint-dir", "ck", "--checkpoint-every", "4", "--resume"), True),
], ids=["only-resumed-from", "saved-into"])
def test_a_resumed_runs_config_toml_repeats_it_from_the_start(tmp_path, given, kept):
    """A resumed run's file leaves out what served the resume alone: --resume,
    --accept-lr-change (refused without --resume) and a checkpoint folder it only resumed
    from (refused without --checkpoint-every or --resume); a folder it saved into stays."""
    import tomllib

    from jaxscale.cli.commands import train
    args = build_parser(commands=["train"]).parse_args(
        ["train", *given, "--out", str(tmp_path / "run")])
    train._write_config(args)
    back = tomllib.loads((tmp_path / "run" / "config.toml").read_text())
    assert "resume" not in back and "accept-lr-change" not in back
    assert ("checkpoint-dir" in back) == kept
    again = config_file.reparse(_sub("train")[1], [], str(tmp_path / "run" / "config.toml"))
    train._checkpoint_options(again)  # the file's options are a valid run: no CheckpointError
