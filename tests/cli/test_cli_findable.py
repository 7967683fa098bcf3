"""What a user looks for and should find (issue 33, item 8): a closed pipe ends quietly;
bare `jaxscale` shows the commands; a misspelt option gets its nearest match; every
option's help says its default; tables print numbers one way per kind; checkpoints can be
pruned and removed."""
import json
import os
import re
import subprocess
import sys

import pytest

from jaxscale.cli.main import COMMANDS, build_parser, main

from conftest import ROOT


def _subparser(name):
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sub.choices[name]


def test_closed_pipe_ends_without_traceback():
    """`plan ... | head -1`: the reader is gone before the output is written."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    p = subprocess.Popen([sys.executable, "-m", "jaxscale", "plan", "--params", "7e9",
                          "--devices", "8"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    p.stdout.close()  # as `head -1` does once it has its line
    err = p.stderr.read()
    assert p.wait(timeout=120) == 1, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_bare_command_prints_usage_and_commands(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: jaxscale")
    for command in ("train", "compare", "plan", "checkpoint"):
        assert re.search(rf"^\s+{command}\b", err, re.M), err


@pytest.mark.parametrize("argv, line", [
    (["train", "--stpes", "5"], "unrecognized argument --stpes; did you mean --steps?"),
    (["plan", "--devices", "8", "--parms", "7e9"],  # before the missing --params is named
     "unrecognized argument --parms; did you mean --params?"),
    (["checkpoint", "ls", "x", "--jsno"], "unrecognized argument --jsno; did you mean --json?"),
])
def test_misspelt_option_names_the_nearest(capsys, argv, line):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err == f"jaxscale: error: {line}"


@pytest.mark.parametrize("command, options", [
    ("train", ["--devices", "--mesh", "--zero", "--remat", "--precision"]),
    ("memory", ["--tp", "--pp", "--cp", "--schedule", "--bytes-per-param", "--offload"]),
])
def test_help_shows_defaults(command, options):
    parser = _subparser(command)
    for option in options:
        help_text = parser._option_string_actions[option].help or ""
        assert "default" in help_text, (option, help_text)
    assert "(default 1f1b)" in " ".join(_subparser("memory").format_help().split())


def _checkpoints(d, complete=(4, 8, 12), incomplete=(16,)):
    """A checkpoint directory as store.py lays it out (no JAX): complete steps with their
    commit marker and JSON item, and saves that never finished."""
    import json
    for step in complete:
        (d / str(step) / "meta").mkdir(parents=True)
        (d / str(step) / "_CHECKPOINT_METADATA").write_text("{}")
        (d / str(step) / "meta" / "metadata").write_text(json.dumps({
            "plan_layout": "dp=1", "config": {"model": "tiny"}, "processes": 1,
            "devices": 1, "data": {"samples_seen": step * 32}}))
    for step in incomplete:
        (d / f"{step}.orbax-checkpoint-tmp").mkdir(parents=True)
        (d / f"{step}.orbax-checkpoint-tmp" / "part").write_text("x" * 10)
    return d


def _steps(d):
    return sorted(p.name for p in d.iterdir() if p.name != ".deleted")


def test_checkpoint_prune_keeps_the_newest(tmp_path, capsys):
    d = _checkpoints(tmp_path)
    assert main(["checkpoint", "prune", str(d), "--keep", "2"]) == 0
    out = capsys.readouterr().out
    assert _steps(d) == ["12", "8"]
    assert "removed step 4, complete" in out and "removed step 16, incomplete" in out
    assert not any((d / ".deleted").iterdir())  # renamed aside, then emptied
    assert main(["checkpoint", "prune", str(d), "--keep", "1", "--json"]) == 0
    import json
    got = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in got["removed"]] == [8] and got["kept"] == [12]


def test_a_file_system_refusal_is_one_line_naming_what_went(tmp_path, capsys, monkeypatch):
    """An OSError (here the second removal refused, as a read-only folder would) is one line
    on stderr with exit 1, not a traceback, and names the steps already removed."""
    import errno

    from jaxscale.training.checkpoint import store
    d = _checkpoints(tmp_path)
    real, calls = store.remove_step, []

    def second_refused(directory, path):
        calls.append(path)
        if len(calls) == 2:
            raise PermissionError(errno.EACCES, "Permission denied", str(d / ".deleted"))
        real(directory, path)
    monkeypatch.setattr(store, "remove_step", second_refused)
    assert main(["checkpoint", "prune", str(d), "--keep", "1"]) == 1
    printed = capsys.readouterr()
    assert printed.out == "" and printed.err.strip() == (
        f"jaxscale: error: Permission denied (removed before it: step 4): {d / '.deleted'}")
    assert _steps(d) == ["12", "16.orbax-checkpoint-tmp", "8"]


def test_checkpoint_rm_one_step(tmp_path, capsys):
    d = _checkpoints(tmp_path)
    assert main(["checkpoint", "rm", str(d), "8", "--json"]) == 0
    import json
    got = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in got["removed"]] == [8] and _steps(d) == [
        "12", "16.orbax-checkpoint-tmp", "4"]


@pytest.mark.parametrize("argv, words", [
    (["prune", "{d}", "--keep", "0"], ["--keep", "0"]),
    (["prune", "{d}/nothing", "--keep", "1"], ["nothing", "not there"]),
    (["rm", "{d}", "5"], ["step 5", "4, 8, 12, 16"]),
])
def test_checkpoint_prune_and_rm_refuse(tmp_path, capsys, argv, words):
    d = _checkpoints(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["checkpoint", *[a.format(d=d) for a in argv]])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1
    assert all(w in err for w in words), err
    assert _steps(d) == ["12", "16.orbax-checkpoint-tmp", "4", "8"]


def test_a_supervised_job_reports_its_whole_wall_time(tmp_path, capsys):
    """The first child dies (exit 1) after 0.3 s, the second prints its JSON: the job's wall
    time covers both, the last child's is kept beside it."""
    import json
    from jaxscale.training.supervise import supervise
    code = ("import json, os, sys, time\n"
            "m = sys.argv[-1]\n"
            "if not os.path.exists(m):\n"
            "    open(m, 'w').close(); time.sleep(0.3); sys.exit(1)\n"
            "print(json.dumps({'train_s': 0.01}))\n")
    done = supervise(["--json", str(tmp_path / "died")], str(tmp_path / "ck"), 2,
                     log=lambda msg: None, program=[sys.executable, "-c", code])
    got = json.loads(capsys.readouterr().out)
    assert done.returncode == 0 and got["restarts"] == done.restarts == 1
    assert got["train_s"] == 0.01  # the child's own keys stay
    assert got["job_wall_s"] == done.wall_s >= 0.3 + got["last_child_wall_s"]
    assert got["last_child_wall_s"] == done.last_wall_s


def test_a_ctrl_c_between_two_supervised_runs_starts_no_third(tmp_path):
    """The Ctrl-C lands while the supervisor logs the restart (after one child died, before
    the next starts): no further child is started, and the job ends with 130."""
    import signal

    from jaxscale.training.supervise import supervise
    done = supervise(["x"], str(tmp_path / "ck"), 3,
                     log=lambda msg: signal.raise_signal(signal.SIGINT),
                     program=[sys.executable, "-c", "import sys; sys.exit(1)"])
    assert done.returncode == 130 and len(done.attempts) == 1


def _compare_row(name, step_s, predicted):
    return {"name": name, "status": "ok", "mesh": "1 device", "max_rel_dloss": 0.0,
            "pass": True, "states_measured": 369_000, "states_predicted": 37_440_000,
            "sent_total": 11_710_000_000, "sent_predicted_total": 512,
            "memory": {"params": 100_000, "master": 0, "optimizer": 269_000,
                       "temporaries": 5},
            "compile_s": 1.0, "compile_source": "cache",
            "step_s": step_s, "step_s_q1": step_s, "step_s_q3": step_s, "step_ratio": 1.0,
            "sent": {"all-reduce": 11_710_000_000},
            "predicted": {"sent": {"all-reduce": 512},
                          "states": {"params": 37_000_000, "optimizer": 440_000}},
            "step_s_predicted": predicted,
            "step_measured_over_predicted": step_s / predicted}


def _compare_result(rows, complete=True):
    return {"model": "tiny", "devices": 8, "steps": 2, "batch_size": 32, "cores": 2,
            "complete": complete, "rows": rows,
            "noise": {"tolerance": 1e-6, "why": "the floor"}}


def test_compare_terminal_table_has_the_predicted_step_time(capsys, monkeypatch):
    from jaxscale.compare import report
    monkeypatch.setenv("COLUMNS", "300")
    report.print_table(_compare_result([_compare_row("single", 0.010, 0.004)]))
    out = capsys.readouterr().out
    assert "step pred" in out and "meas/pred" in out
    assert "4 ms" in out and "2.5" in out  # 0.004 s predicted; 10 ms / 4 ms measured
    # bytes always with a unit and a space, in the table and the markdown
    assert "369 kB" in out and "37.44 MB" in out and "11.71 GB" in out and "512 B" in out
    assert "11.71 GB" in report.markdown(_compare_result([_compare_row("single", 0.01,
                                                                       0.004)]))


def test_an_interrupted_compare_prints_the_finished_rows(capsys, monkeypatch):
    import json
    from jaxscale.compare import report
    monkeypatch.setenv("COLUMNS", "300")
    rows = [_compare_row("single", 0.010, 0.004)]
    saved = []
    report.print_partial(_compare_result(rows, complete=False), True, saved.append)
    got = json.loads(capsys.readouterr().out)
    assert saved == [rows]  # compare.json first
    assert got["complete"] is False and [r["name"] for r in got["rows"]] == ["single"]
    report.print_partial(_compare_result(rows, complete=False), as_json=False)
    assert "single" in capsys.readouterr().out
    report.print_partial(_compare_result([], complete=False), as_json=False)
    assert capsys.readouterr().out == ""  # nothing finished: no empty table


def test_table_numbers_one_style_per_kind():
    from jaxscale.report import _fmt, plural
    assert _fmt(136512.4) == "136,512" and "e" not in _fmt(1.5e12)
    assert _fmt(54321.7) == "54,322" and _fmt(12345.0) == "12,345"  # not 5.432e+04
    assert _fmt(0.5) == "0.5" and _fmt(12.25) == "12.25"
    assert plural(1, "micro-batch", "micro-batches") == "1 micro-batch"
    assert plural(4, "micro-batch", "micro-batches") == "4 micro-batches"


CALCULATORS = [["--help"], ["memory", "--params", "7e9", "--devices", "8"],
               ["comm", "--params", "7e9", "--devices", "8"], ["failures", "--devices", "1024"],
               ["plan", "--params", "7e9", "--devices", "8"], ["schedule", "--help"],
               ["checkpoint", "--help"]]


def test_a_calculator_starts_without_jax():
    """A command line imports only its own command's module: the calculators run with JAX,
    Flax, Optax and Orbax made unimportable (about a second of start-up they never use)."""
    code = ("import sys\n"
            "for m in ('jax', 'jaxlib', 'flax', 'optax', 'orbax'): sys.modules[m] = None\n"
            "from jaxscale.cli.main import main\n"
            "for argv in __import__('json').loads(sys.argv[1]):\n"
            "    try:\n"
            "        assert main(argv) == 0, argv\n"
            "    except SystemExit as e:\n"
            "        assert e.code == 0, argv\n")
    r = subprocess.run([sys.executable, "-c", code, json.dumps(CALCULATORS)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_command_list_is_the_same_whichever_command_runs():
    """`jaxscale --help` lists each command with the line its own module gives it."""
    full, bare = build_parser(), build_parser(commands=[])
    assert bare.format_help() == full.format_help()
    lines = {a.dest: a.help for a in next(
        a for a in full._actions if a.dest == "command")._choices_actions}
    assert lines == COMMANDS
