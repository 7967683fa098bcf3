"""Every `jaxscale ...` command README.md shows works as shown.

The calculators (closed forms, no JAX) are run in-process with --json, files going to
tmp_path. `train` commands are sized for minutes, so they run up to the training loop:
options parsed, the config validated, devices and mesh set up, then the loop is replaced.
`compare` lines run up to their workers: every strategy validated and its plan built, then
the run is replaced (the compare tests run the command itself, end to end and --abstract).
`launch` lines run up to starting their processes: every check passed, each process's
command line built and parsed (tests/parallel/test_multiprocess.py launches for real).
`plan --verify` lines run up to XLA:TPU's compile (tests/runtime/test_targets.py compiles).
"""
import json
import re
import shlex
from pathlib import Path

import jax
import pytest

from jaxscale.training import loop as train_loop
from jaxscale.cli.main import main
from jaxscale.runtime import processes
from jaxscale.training import reference
from jaxscale.training.config import TrainConfig

README = Path(__file__).resolve().parents[2] / "README.md"
CALCULATORS = {"memory", "comm", "failures", "plan", "schedule"}
FILE_OPTIONS = {"--png", "--out", "--checkpoint-dir", "--input", "--validation", "--profile"}


def readme_commands() -> list[tuple[list[str], str]]:
    """(argv without 'jaxscale', the line's trailing comment) for each command shown, in code
    blocks and in inline code, in order and without repeats."""
    text = README.read_text()
    lines = [line for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M)
             for line in block.splitlines()]
    lines += re.findall(r"`(jaxscale [^`]+)`", text)
    seen, out = set(), []
    for line in lines:
        command, _, comment = line.partition("#")
        command = command.strip()
        if command.startswith("jaxscale ") and command not in seen:
            seen.add(command)
            out.append((shlex.split(command)[1:], comment.strip()))
    return out


COMMANDS = readme_commands()
CALCULATOR_LINES = [(a, c) for a, c in COMMANDS if a[0] in CALCULATORS]
TRAIN_LINES = [a for a, _ in COMMANDS if a[0] == "train"]
COMPARE_LINES = [a for a, _ in COMMANDS if a[0] == "compare"]
LAUNCH_LINES = [a for a, _ in COMMANDS if a[0] == "launch"]
DATA_LINES = [a for a, _ in COMMANDS if a[0] == "data"]
BENCH_LINES = [a for a, _ in COMMANDS if a[0] == "bench"]


def _ids(argv) -> str:
    return " ".join(argv)[:60]


def _needs_the_targets_compiler(argv) -> None:
    """Skip a `--target` line, with the install command, where its compiler is missing (the
    test command installs libtpu; the CUDA plugin is optional)."""
    if "--target" in argv:
        from jaxscale.runtime import targets
        try:
            targets.available_target(argv[argv.index("--target") + 1])
        except targets.TargetError as e:
            pytest.skip(str(e))


def _to_tmp(argv: list[str], tmp_path: Path) -> list[str]:
    """The same command with every output file or folder inside tmp_path."""
    out = list(argv)
    for i, arg in enumerate(out[:-1]):
        if arg in FILE_OPTIONS:
            out[i + 1] = str(tmp_path / Path(out[i + 1]).name)
    return out


def test_the_readme_shows_every_calculator_and_train():
    assert {a[0] for a, _ in CALCULATOR_LINES} == CALCULATORS
    assert len(TRAIN_LINES) >= 3


@pytest.mark.parametrize("argv, comment", CALCULATOR_LINES,
                         ids=[_ids(a) for a, _ in CALCULATOR_LINES])
def test_calculator_line_runs(cli, tmp_path, monkeypatch, argv, comment):
    _needs_the_targets_compiler(argv)
    compiled = []
    if "--verify" in argv:  # run up to XLA:TPU's compile, as compare lines run up to their
        # workers: the planner's best rows built into plans and checked against the model,
        # each handed to the compiler (tests/runtime/test_targets.py compiles for real; the
        # two 7B programs would take two minutes here)
        from jaxscale.compare import abstract

        def compile_only(cfg, plans, devices, batch, target):
            compiled.extend(plans.values())
            return [{"needed_bytes": 1, "fits": True, "memory": {}} for _ in plans]
        monkeypatch.setattr(abstract, "run_abstract", compile_only)
    result = cli(*_to_tmp(argv, tmp_path), "--json")
    assert isinstance(result, dict) and result
    if "--verify" in argv:
        n = int(argv[argv.index("--verify") + 1])
        assert len(compiled) == n and all(r["buildable"] for r in result["verified"]["rows"])
    if "--png" in argv:
        assert (tmp_path / Path(argv[argv.index("--png") + 1]).name).stat().st_size > 1000


def test_the_zero_paper_figures_in_the_readme_are_what_memory_prints(cli):
    (argv, comment), = [(a, c) for a, c in CALCULATOR_LINES if "ZeRO paper" in c]
    claimed = re.findall(r"\d+(?:\.(\d+))?", comment.split(":", 1)[1])  # decimals shown
    figures = re.findall(r"\d+(?:\.\d+)?", comment.split(":", 1)[1])
    totals = [x["total"] / 1e9 for x in cli(*argv, "--json")["model_states"]["mixed"]]
    assert len(figures) == len(totals) == 4
    assert [round(t, len(d)) for t, d in zip(totals, claimed)] == [float(f) for f in figures]


class _Stop(Exception):
    pass


def _save_a_checkpoint_as(argv, tmp_path, monkeypatch):
    """What a --resume line needs: the same line without --resume, saving a real step-0
    checkpoint of its config (from one device: checkpoints do not depend on the plan)."""
    from dataclasses import replace

    from jaxscale.training.checkpoint.manager import Checkpointer
    from jaxscale.training.checkpoint.meta import run_meta
    from jaxscale.model.config import preset
    from jaxscale.parallel.plan import Plan
    from jaxscale.parallel.build import build_train_step

    def save(cfg, checkpoint=None, **kwargs):
        _, params, optimizer = reference.init_run(cfg)
        init, step = build_train_step(preset(cfg.model), Plan(precision=cfg.precision),
                                      optimizer, jax.devices()[:1])
        with Checkpointer(replace(checkpoint, resume=False)) as ckpt:
            ckpt.save(0, step.canonical.to_canonical(init(params)),
                      run_meta(cfg, cfg.plan(), 0, [], [], [], 0))
        raise _Stop

    monkeypatch.setattr(train_loop, "train", save)
    with pytest.raises(_Stop):
        main(_to_tmp([a for a in argv if a != "--resume"], tmp_path))


def _child_of_supervisor(argv, monkeypatch) -> list[str]:
    """A --max-restarts line runs its supervisor up to starting the child: the child's
    command line, which is then run here as the child would (the supervisor's variable set)."""
    from jaxscale.training import supervise

    children = []

    def start(argv, *args, **kwargs):
        children.append(argv)
        raise _Stop

    monkeypatch.setattr(supervise, "supervise", start)
    with pytest.raises(_Stop):
        main(argv)
    monkeypatch.setenv(processes.SUPERVISED_ENV, "1")
    return children[0]


@pytest.mark.parametrize("argv", TRAIN_LINES, ids=[_ids(a) for a in TRAIN_LINES])
def test_train_line_gets_to_the_training_loop(tmp_path, monkeypatch, argv):
    if "--resume" in argv:
        _save_a_checkpoint_as(argv, tmp_path, monkeypatch)
    argv = _to_tmp(argv, tmp_path)
    if "--max-restarts" in argv:
        argv = _child_of_supervisor(argv, monkeypatch)
    configs = []

    def stop(cfg, **kwargs):
        configs.append(cfg)
        raise _Stop

    monkeypatch.setattr(train_loop, "train", stop)
    with pytest.raises(_Stop):
        main(argv)
    (cfg,) = configs
    if any(word.startswith("--") for word in argv):
        assert _options_kept(argv, cfg), argv
    else:  # the plain line trains the defaults
        assert cfg == TrainConfig(), cfg


def _options_kept(argv, cfg) -> int:
    """Every option of the line that names a TrainConfig field reached the config with the
    line's value (a flag: True); the number of options checked, at least one per line.
    `auto` values are resolved by the CLI (the attention kernel) and not compared."""
    checked = 0
    for i, word in enumerate(argv):
        if not word.startswith("--"):
            continue
        name, _, value = word[2:].partition("=")
        if not value and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = argv[i + 1]
        field = name.replace("-", "_")
        if not hasattr(cfg, field) or value == "auto":
            continue
        want = getattr(cfg, field)
        got = True if isinstance(want, bool) else type(want)(value) if want is not None else value
        assert want == got, (name, value, want)
        checked += 1
    return checked


@pytest.mark.parametrize("argv", COMPARE_LINES, ids=[_ids(a) for a in COMPARE_LINES])
def test_compare_line_gets_to_its_workers(tmp_path, monkeypatch, argv):
    _needs_the_targets_compiler(argv)
    from jaxscale.cli.commands import compare as compare_command
    from jaxscale.compare import run as compare_runner
    specs = []

    def stop(spec, *args, **kwargs):
        specs.append(spec)
        raise _Stop

    monkeypatch.setattr(compare_runner, "run_all", stop)
    monkeypatch.setattr(compare_command, "_run_abstract",
                        lambda args, cfg, plans, out, target=None:
                        stop({"strategies": list(plans)}))
    with pytest.raises(_Stop):
        main(_to_tmp(argv, tmp_path) + ["--out", str(tmp_path / "c")])
    (spec,) = specs
    assert spec["strategies"]


def test_the_readme_shows_launch():
    assert len(LAUNCH_LINES) >= 2


@pytest.mark.parametrize("argv", LAUNCH_LINES, ids=[_ids(a) for a in LAUNCH_LINES])
def test_launch_line_gets_to_its_processes(tmp_path, monkeypatch, argv):
    from jaxscale.cli import main as cli
    from jaxscale.cli.commands import launch
    started = []

    def stop(argvs, logs, **kwargs):
        started.append(argvs)
        raise _Stop

    monkeypatch.setattr(launch, "launch", stop)
    monkeypatch.delenv("JAXSCALE_LAUNCHED", raising=False)
    with pytest.raises(_Stop):
        main(argv[:1] + ["--logs", str(tmp_path / "logs")] + _to_tmp(argv[1:], tmp_path))
    (argvs,) = started
    p = int(argv[argv.index("--processes") + 1])
    assert len(argvs) == p
    for i, child in enumerate(argvs):  # each child's own command line parses
        cli.build_parser().parse_args(child[3:])
        assert child[child.index("--process-id") + 1] == str(i)


def test_the_readme_shows_data_clean():
    assert len(DATA_LINES) >= 3 and any("--input" in a for a in DATA_LINES)


@pytest.mark.parametrize("argv", DATA_LINES, ids=[_ids(a) for a in DATA_LINES])
def test_data_line_runs(cli, tmp_path, monkeypatch, argv):
    """Each `data clean` line, end to end, on at most 600 pages: its --input and
    --validation files made here (garden web pages as JSONL, validation documents as
    text), --devices taken from the session's eight."""
    import jax

    from jaxscale.runtime import devices as devlib
    from jaxscale.data.web import make_web

    monkeypatch.setattr(devlib, "pick_devices", lambda platform, n: jax.devices()[:n])
    argv = _to_tmp(argv, tmp_path)
    web = make_web(600, seed=0)
    for flag, lines in (("--input", [json.dumps({"id": i, "text": t})
                                     for i, t in zip(web.ids, web.texts)]),
                        ("--validation", list(web.validation))):
        if flag in argv:
            path = tmp_path / Path(argv[argv.index(flag) + 1]).name
            path.write_text("\n".join(lines) + "\n")
            argv[argv.index(flag) + 1] = str(path)
    if "--docs" in argv:
        i = argv.index("--docs") + 1
        argv[i] = str(min(int(argv[i]), 600))
    elif "--input" not in argv:  # the default corpus, smaller
        argv += ["--docs", "600"]
    result = cli(*argv, *([] if "--json" in argv else ["--json"]))
    assert 0 < result["kept"] < result["docs"] <= 600
    if "--out" in argv:
        assert (tmp_path / Path(argv[argv.index("--out") + 1]).name / "kept.jsonl").is_file()


def test_the_readme_shows_bench():
    assert BENCH_LINES


@pytest.mark.slow
@pytest.mark.parametrize("argv", BENCH_LINES, ids=[_ids(a) for a in BENCH_LINES])
def test_bench_line_runs(cli, tmp_path, argv):
    """Each `bench` line as shown, with one timed step and no warm-up (the options that set
    the length, appended: argparse keeps the last); an --abstract line compiles its rows."""
    _needs_the_targets_compiler(argv)
    out = cli(*_to_tmp(argv, tmp_path), "--steps", "1", "--warmup", "0", "--json")
    if "--abstract" in argv:
        assert out["rows"] and all(r["needed_bytes"] or r["refused"] for r in out["rows"])
        return
    assert out["rows"] and all(r["tokens_per_s"] > 0 for r in out["rows"])
