"""`compare --save-baseline` and `--baseline`: a run checked against an earlier one."""
import json

import pytest

from jaxscale.cli.main import main

RUN = ("compare", "--strategies", "dp", "--steps", "3", "--repeats", "3", "--json")


@pytest.mark.slow
def test_a_round_trip_passes_and_a_changed_run_fails_with_what_moved(cli, capsys, tmp_path):
    base = tmp_path / "base.json"
    first = cli(*RUN, "--out", str(tmp_path / "a"), "--save-baseline", str(base))
    assert json.loads(base.read_text())["rows"] == first["rows"]
    again = cli(*RUN, "--out", str(tmp_path / "b"), "--baseline", str(base))
    report = again["baseline"]
    assert report["unchanged"] and report["compared"] == ["single", "control", "dp"]
    # the same run against a baseline whose dp row differs in each checked figure
    saved = json.loads(base.read_text())
    dp = next(r for r in saved["rows"] if r["name"] == "dp")
    dp["losses"][1] *= 1 + 1e-3
    dp["sent"]["all-reduce"] += 4
    dp["states_measured"] += 8
    base.write_text(json.dumps(saved))
    own = tmp_path / "c" / "compare.json"  # --save-baseline may name the run's own file
    own.parent.mkdir()
    assert main([*RUN, "--out", str(tmp_path / "c"), "--baseline", str(base),
                 "--save-baseline", str(own)]) == 1
    printed = capsys.readouterr()
    assert json.loads(own.read_text())["rows"] == json.loads(printed.out)["rows"]
    assert "what moved since the baseline (3)" in printed.err
    moved = json.loads(printed.out)
    what = {m["what"]: m for m in moved["baseline"]["moved"]}
    assert set(what) == {"losses (largest relative difference)", "bytes sent: all-reduce",
                         "model-state bytes"}
    assert {m["strategy"] for m in what.values()} == {"dp"}
    assert what["losses (largest relative difference)"]["now"] == pytest.approx(1e-3, rel=1e-3)
    assert what["bytes sent: all-reduce"]["baseline"] - what["bytes sent: all-reduce"]["now"] == 4


def _refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    return err


def test_a_baseline_of_another_job_or_unreadable_is_refused_before_running(capsys, tmp_path):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"model": "tiny8", "devices": 8, "steps": 3, "batch_size": 32,
                                 "platform": "auto", "rows": []}))
    gpu = tmp_path / "gpu.json"
    gpu.write_text(json.dumps({"model": "tiny", "devices": 8, "steps": 3, "batch_size": 32,
                               "rows": [{"name": "single", "platform": "gpu"}]}))
    assert "ran on gpu, this run runs on cpu" in _refused(
        [*RUN, "--platform", "cpu", "--baseline", str(gpu)], capsys)
    err = _refused([*RUN, "--baseline", str(other)], capsys)
    assert "model = 'tiny8', this run has 'tiny'" in err
    assert "cannot read the baseline" in _refused([*RUN, "--baseline", str(tmp_path / "no")],
                                                  capsys)
    (tmp_path / "bad.json").write_text("{")
    assert "is not JSON" in _refused([*RUN, "--baseline", str(tmp_path / "bad.json")], capsys)
    (tmp_path / "list.json").write_text("[]")
    assert "has no rows" in _refused([*RUN, "--baseline", str(tmp_path / "list.json")], capsys)
    assert "drop --abstract" in _refused(["compare", "--abstract", "--baseline",
                                          str(other)], capsys)
    assert "'x.txt'" in _refused(["compare", "--save-baseline", "x.txt"], capsys)
    fp32 = tmp_path / "fp32.json"
    fp32.write_text(json.dumps({"model": "tiny", "devices": 8, "steps": 3, "batch_size": 32,
                                "rows": [{"name": "single", "plan": {"precision": "fp32"}}]}))
    assert "ran in precision 'fp32', this run in 'fp8'" in _refused(
        [*RUN, "--precision", "fp8", "--baseline", str(fp32)], capsys)
