"""What the command line used to accept in silence, or refuse in the wrong way (issue 33's
items 3, 6 and 7), each now refused in one line with exit 2, before any work, or noted.

Refusals run in this process, table-driven; the notes that need a run use the tiny model
for one or two steps.
"""
import json

import pytest

PLAN = ["plan", "--params", "7e9", "--devices", "8"]


@pytest.mark.parametrize("argv, words", [
    # item 3: a parameter count far from every published shape is not planned as one
    (["plan", "--params", "1e6", "--devices", "8"], ["1e+06", "Llama-2-7B", "6.74e+03x away",
                                                     "Megatron 1T"]),
    (["plan", "--params", "1e15", "--devices", "8"], ["Megatron 1T (1e+12)", "1e+03x away"]),
    # item 6: injections the run never reaches; pipeline sizes `schedule` refuses
    (["train", "--inject", "nan@50", "--steps", "10"], ["nan@50", "from 1 to 10"]),
    (["memory", "--params", "7e9", "--pp", "4", "--virtual", "2", "--micro-batches", "1"],
     ["multiple of the stages", "m=1, p=4"]),
    (["memory", "--params", "7e9", "--pp", "2", "--virtual", "2", "--micro-batches", "3"],
     ["m=3, p=2", "try m=4"]),
    (["comm", "--params", "7e9", "--tp", "4"], ["--tp needs the model's shape"]),
    (["comm", "--params", "7e9", "--pp", "2", "--recompute"], ["--pp and --recompute need"]),
    # item 7: --fix values no mesh can take; the device limit; why pp x virtual fails
    ([*PLAN, "--fix", "dp=3"], ["dp=3", "divide the 8 devices", "[1, 2, 4, 8]"]),
    ([*PLAN, "--fix", "dp=1,dp=2"], ["dp=1 and dp=2"]),
    ([*PLAN, "--fix", "dp=1,tp=2,pp=2,cp=1"], ["product 4 must equal the 8 devices"]),
    ([*PLAN, "--fix", "tp=128"], ["tp=128", "divide the 8 devices"]),
    ([*PLAN, "--fix", "dp=4,tp=4"], ["product 16", "8 devices"]),
    (["compare", "--devices", "100000"], ["100000 forced CPU devices", "at most 512"]),
    (["train", "--mesh", "dp=2,tp=2,pp=2", "--schedule", "interleaved", "--virtual", "3",
      "--micro-batches", "4"], ["2 x 3 = 6 chunks", "the 2 layers", "choose virtual from"]),
    (["launch", "--processes", "2", "--devices-per-process", "4", "--", "compare",
      "--abstract"], ["compare --abstract compiles in one process"]),
    # an unknown schedule is named as unknown, whatever else is given
    (["schedule", "--schedule", "zb1", "--weight-cost", "0.5"],
     ["unknown pipeline schedule 'zb1'", "zb-h1"]),
    # nothing asked of steps that never run is dropped in silence
    (["compare", "--abstract", "--profile", "prof"], ["--profile keeps what training steps"]),
    (["compare", "--abstract", "--profile", "prof", "--save-params", "params"],
     ["--profile and --save-params keep", "drop them or --abstract"]),
])
def test_refused_in_one_line_before_any_work(fail, argv, words):
    err = fail(*argv)
    for w in words:
        assert w in err, err
    assert "from []" not in err


def test_plan_near_a_published_shape_still_plans_it(cli):
    r = cli("plan", "--params", "5e9", "--devices", "8", "--json")
    assert "Llama-2-7B" in r["shape_source"] and r["recommended"]
    r = cli("plan", "--params", "7e9", "--devices", "8", "--fix", "dp=1,dp=1", "--json")
    assert all(x["layout"]["dp"] == 1 for x in [r["recommended"], *r["alternatives"]])


def test_async_saves_slower_than_sync_ones_are_noted(cli):
    out = cli("failures", "--async-blocking-minutes", "20", "--save-minutes", "10")
    assert "asynchronous saving cannot win here" in out
    assert "cannot win" not in cli("failures")


@pytest.mark.slow
def test_a_warmup_longer_than_half_the_run_is_noted_and_recorded(capsys, tmp_path):
    from jaxscale.cli.main import main

    assert main(["train", "--model", "tiny", "--steps", "4", "--warmup", "5000",
                 "--eval-every", "1000", "--train-docs", "256", "--out", str(tmp_path),
                 "--json"]) == 0
    out = capsys.readouterr()
    assert "--warmup 5,000 is more than half of --steps 4" in out.err
    r = json.loads(out.out.splitlines()[-1])
    assert r["warmup_steps"] == 2 and r["config"]["warmup"] == 5000


@pytest.mark.slow
def test_idle_devices_are_noted(capsys, tmp_path):
    from jaxscale.cli.main import main

    assert main(["train", "--model", "tiny", "--steps", "2", "--devices", "8",
                 "--eval-every", "1000", "--train-docs", "256", "--out", str(tmp_path),
                 "--json"]) == 0
    err = capsys.readouterr().err
    assert "the mesh is dp=1, so 7 devices stay idle" in err and "--mesh dp=8" in err


@pytest.mark.slow
def test_a_halted_run_does_not_say_it_diverged(capsys, tmp_path):
    from jaxscale.cli.main import main

    assert main(["train", "--model", "tiny", "--steps", "6", "--halt-after", "2",
                 "--eval-every", "1000", "--train-docs", "256", "--checkpoint-dir",
                 str(tmp_path / "ck"), "--checkpoint-every", "2", "--out",
                 str(tmp_path / "out")]) == 0
    out = " ".join(capsys.readouterr().out.replace("│", " ").split())  # cells may wrap
    assert "not measured (halted (--halt-after) after 2 steps, before the first" in out
    assert "diverged" not in out


def test_a_compare_worker_that_dies_before_its_first_strategy_is_a_failed_run(
        capsys, tmp_path, monkeypatch):
    """A worker killed before it starts (out of memory, a runtime abort) ends compare with
    exit 1, the run went wrong, in one line naming where the finished rows are; exit 2 is
    for options, and these were valid."""
    from jaxscale.cli.main import main
    from jaxscale.compare import run
    from jaxscale.compare.child import WorkerCrashed

    def one_row_then_dead(spec, on_row, log, **_):
        on_row([{"name": "single", "pass": True}])
        raise WorkerCrashed("the compare worker exited (killed by SIGKILL) before it started "
                            "a strategy: (no output)")
    monkeypatch.setattr(run, "run_all", one_row_then_dead)
    monkeypatch.setattr("jaxscale.compare.strategies.judge", lambda rows, tolerance: {})
    out = tmp_path / "c"
    assert main(["compare", "--strategies", "dp", "--steps", "1", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == ("jaxscale: error: the compare worker exited (killed by SIGKILL) before it "
                   "started a strategy: (no output); 1 strategy finished before it, in "
                   f"{out / 'compare.json'}")
    assert json.loads((out / "compare.json").read_text())["rows"][0]["name"] == "single"
