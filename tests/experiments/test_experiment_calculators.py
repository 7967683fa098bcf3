"""experiments.day4_checks and experiments.failures, in-process (pure Python, fast)."""
import json
import math

import pytest

GIB = 2**30


def _run(main, tmp_path, capsys, *parts):
    argv = ["--out", str(tmp_path), "--json"] + (["--parts", "".join(parts)] if parts else [])
    assert main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    assert json.loads((tmp_path / "results.json").read_text()).keys() == res.keys()
    return res


def test_day4_checks(tmp_path, capsys):
    from experiments.day4_checks import main
    res = _run(main, tmp_path, capsys)
    rows = {r["what"]: r["bytes"] for r in res["3"]["rows"]}
    assert round(rows["model states (16 bytes/parameter)"] / GIB, 1) == round(16 * 6.74e9 / GIB, 1) == 100.4
    assert round(rows["activations, flash attention"] / GIB) == round(32 * 34 * 4096 * 4096 / GIB) == 17
    assert round(rows["activations, checkpointing + flash attention"] / GIB, 1) == 1.5
    assert res["3"]["recompute_extra_compute"] == pytest.approx(1 / 3)
    z = res["5"]["7B on 8 devices (GiB)"]["rows"]
    assert [round(r["total"], 1) for r in z] == [104.3, 35.9, 24.4, 13.0]
    paper = res["5"]["ZeRO paper: 7.5B on 64 devices (GB)"]["rows"]
    assert [round(r["total"], 1) for r in paper[:3]] == [120.0, 31.4, 16.6]
    assert res["5"]["exercise_2"] == {"total_GB": pytest.approx(1120), "zero3_on_64_GB": pytest.approx(17.5),
                                      "min_80GB_cards_zero3": 14}
    assert res["6"]["bubble"]["8"]["16"] == pytest.approx(7 / 23)
    assert res["6"]["min_micro_batches_for_10pct"] == {"2": 9, "4": 27, "8": 63, "16": 135}
    r7 = {r["what"][:8]: r for r in res["7"]["rows"]}
    assert round(r7["DP: ring"]["bytes"] / GIB, 1) == 22.8
    assert r7["TP: one "]["bytes"] == 32 * 2**20 and r7["TP: a st"]["bytes"] == 4 * GIB
    assert round(r7["1 GiB"]["seconds"]["NVLink ~600 GB/s"] * 1e3, 1) == 1.8
    assert round(r7["1 GiB"]["seconds"]["InfiniBand ~25 GB/s per device"] * 1e3) == 43
    lec = res["7"]["lecture13"]
    assert (round(lec["tp_allreduce_MB"]), round(lec["tp_per_step_GB"], 1),
            round(lec["pp_boundary_per_step_MB"])) == (134, 17.2, 268)


@pytest.mark.slow
def test_failures_experiment(tmp_path, capsys):
    from experiments.failures import main
    res = _run(main, tmp_path, capsys)
    hours = {r["devices"]: r["cluster_mtbf_hours"] for r in res["a"]["rows"]}
    assert hours[8] == 6250 and round(hours[1024], 1) == 48.8 and round(hours[16384], 1) == 3.1
    b = {r["devices"]: r for r in res["b"]["rows"]}
    assert round(b[1024]["young_interval"]) == 242
    assert b[1024]["numeric_argmin_first_order"] == pytest.approx(b[1024]["young_interval"], rel=1e-3)
    assert round(100 * b[1024]["young_waste"], 1) == 8.3
    assert round(100 * b[16384]["young_waste"]) == 33
    assert b[1024]["numeric_argmin_exact"] == pytest.approx(b[1024]["daly_interval"], rel=1e-2)
    c = {(r["devices"], r["kind"]): r for r in res["c"]["rows"]}
    a = c[(1024, "asynchronous")]
    assert round(a["interval"]) == round(math.sqrt(2 * 1 * 50000 / 1024 * 60)) == 77
    assert round(100 * a["waste_write_ignored"], 1) == 2.6
    assert a["waste_with_write"] > a["waste_write_ignored"]
    assert (tmp_path / "b_waste_vs_interval.png").stat().st_size > 10_000


def test_bad_parts(tmp_path):
    from experiments.failures import main
    with pytest.raises(SystemExit) as e:
        main(["--parts", "xyz", "--out", str(tmp_path)])
    assert e.value.code == 2


@pytest.mark.slow
def test_failures_experiment_measured_delta(tmp_path, capsys):
    """Part d: delta measured by a real save of the tiny model, Young's interval from it."""
    from experiments.failures import main
    res = _run(main, tmp_path, capsys, "d")
    d = res["d"]
    m = d["mtbf_minutes"]
    assert d["devices"] == 1024 and m == pytest.approx(50_000 / 1024 * 60)
    rows = {r["source"]: r for r in d["rows"]}
    assert rows["lecture"]["save_minutes"] == 10 and round(rows["lecture"]["young_interval_minutes"]) == 242
    sync, lazy = rows["measured sync"], rows["measured async"]
    assert sync["save_seconds"] == d["measured"]["sync"]["blocked_s"] > 0
    assert lazy["save_seconds"] == d["measured"]["async"]["blocked_s"] > 0
    assert lazy["write_seconds"] == d["measured"]["async"]["background_s"] >= 0
    for r in d["rows"]:
        assert r["save_minutes"] == pytest.approx(r["save_seconds"] / 60)
        assert r["young_interval_minutes"] == pytest.approx(math.sqrt(2 * r["save_minutes"] * m))
        assert r["young_interval_seconds"] == pytest.approx(60 * r["young_interval_minutes"])
    assert sync["young_interval_minutes"] < rows["lecture"]["young_interval_minutes"]
    assert d["measured"]["state_bytes"] > 0
    assert list(tmp_path.iterdir()) == [tmp_path / "results.json"]  # the checkpoints are gone


def test_cost_model_experiment(tmp_path, capsys):
    """experiments.cost_model: the published figures next to ours, every part."""
    from experiments.cost_model import main
    res = _run(main, tmp_path, capsys)
    assert all(r["rounds_to_published"] for r in res["b"]["table1"])
    assert all(0.7 < r["ratio"] < 1.0 for r in res["a"]["table5"])
    assert [round(r["reduction"], 2) for r in res["a"]["activations"]][1] == 5.41
    ranks = {(r["paper"], r["model"]): r["rank"] for r in res["d"]["ranks"]}
    assert ranks[("Korthikanti", "530B")] == ranks[("Korthikanti", "1T")] == 1
    assert all(ranks[("Narayanan", m)] <= 3 for m in ("76.1B", "145.6B", "310.1B", "529.6B",
                                                       "1008.0B"))
    # Where we rank a published layout lower, our model predicts it at most 12% slower than
    # our first choice: inside the model's own error on Korthikanti's Table 5 (5-28%).
    gaps = [r["slower_than_ours"] for r in res["d"]["ranks"]]
    assert max(gaps) < 0.12 and all(g == 0.0 for g, r in zip(gaps, res["d"]["ranks"])
                                    if r["rank"] == 1)
    assert round(res["c"]["estimates"]["gpt3_8TP_days"]) == 34
    assert {r["published"]: round(r["ours"]) for r in res["e"]["rows"]}["377"] == 378
