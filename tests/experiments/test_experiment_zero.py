"""experiments.zero in a fresh process (it forces its own 8 devices): parts a, c, d, e.
(Part b's 40-step runs are checked, tighter, in test_zero.)"""
import json

import pytest

from conftest import run_python


pytestmark = pytest.mark.slow  # one run of the experiment (about 30 s warm) serves them all


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero")
    r = run_python("import runpy, sys; sys.argv[0] = 'x'; "
                   "runpy.run_module('experiments.zero', run_name='__main__')",
                   "--parts", "acde", "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout), out, r.stderr  # with --json the tables go to stderr


def test_zero_paper_table_and_exercise_2(results):
    res, out, _ = results
    a = res["a"]
    assert [round(a[str(s)]["mixed_gb"], 1) for s in range(4)] == [120.0, 31.4, 16.6, 1.9]
    assert a["3"]["mixed_gb"] == 16 * 7.5e9 / 64 / 1e9  # 1.875, the paper's 1.88
    assert res["e"] == {"total_gb": pytest.approx(1120), "zero3_on_64_gb": pytest.approx(17.5),
                        "fewest_80gb_devices": 14}
    assert (out / "zero_70b.png").stat().st_size > 1000


def test_compiled_model_states_within_two_percent_of_the_formulas(results):
    c = results[0]["c"]
    assert len(c) == 8
    for name, row in c.items():
        assert abs(row["rel_diff"]) < 0.02, name
        assert row["total"] >= row["formula"]  # only the scalars ride on top
        # the accumulator read from the program's scan has the closed form's size
        assert row["grads"] == row["grads_formula"], name
    for prec in ("bf16", "fp32"):
        grads = [c[f"{prec}_stage{s}"]["grads"] for s in range(4)]
        assert grads[0] == grads[1] and grads[2] == grads[3]  # whole, then sliced from stage 2
        assert grads[0] // 4 <= grads[2] < grads[0] // 4 * 1.01  # 1/K, plus padding
    assert c["fp32_stage0"]["grads"] == 2 * c["bf16_stage0"]["grads"]  # fp32 vs bf16 gradients


def test_activation_table_and_measured_residuals(results):
    d = results[0]["d"]
    t = d["lecture_table"]
    assert round(t["per_layer_gb"], 1) == 7.7 and round(t["total_gb"]) == 245
    assert 11 < t["recompute_gb"] < 13
    tables = results[2]  # the table names its rows and its unit, not results.json's keys
    assert "16-bit; GB = 1e9 bytes" in tables and "all 32 layers, each recomputed" in tables
    assert "7,650,410,496" in tables  # one layer's bytes, 2048*8*4096*(34 + 80), beside the GB
    assert not any(key in tables for key in t)
    ours = d["ours"]
    # full remat keeps one block input per layer, nothing else: exactly 1 s*b*h tensor
    assert ours["full"]["sbh_tensors_per_layer"] == 1.0
    assert ours["full"]["as2b_tensors_per_layer"] == 0.0
    assert ours["none"]["per_layer_bytes"] > ours["matmuls"]["per_layer_bytes"] > \
        ours["full"]["per_layer_bytes"]
    assert ours["none"]["per_layer_bytes"] > d["formula_per_layer_fp32_no_dropout"]
    assert 1.1 < ours["full"]["flops_vs_none"] < 4 / 3  # one more forward of the blocks
