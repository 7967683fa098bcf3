"""`jaxscale explain`: every tensor's placement, totals equal to compare's measured model
state, two plans side by side, the ZeRO flag, bad input."""
import importlib.util
import math

import numpy as np
import pytest

from jaxscale.compare import explain
from jaxscale.parallel.plan import Plan

PLAN = "dp=2,tp=2,pp=2,zero=3,micro_batches=2"


@pytest.mark.slow
def test_totals_equal_compares_measured_model_state_to_the_byte(cli, tmp_path):
    """ZeRO-3 x tp x pp on tiny8: explain's bytes come from the shardings' shapes, compare's
    from the buffers on its first device after training; they must agree exactly."""
    out = cli("explain", "--strategy", PLAN, "--model", "tiny8", "--json")
    (run,) = out["plans"]
    measured = cli("compare", "--model", "tiny8", "--strategy", PLAN, "--steps", "2",
                   "--repeats", "3", "--out", str(tmp_path), "--json")
    row = next(r for r in measured["rows"] if r["name"] == PLAN)
    assert run["totals"]["model_state"] == row["states_measured"] > 0
    for r in run["rows"]:
        assert r["bytes_per_device"] == math.prod(r["per_device_shape"]) * np.dtype(
            r["dtype"]).itemsize
        assert r["flag"] is None and r["devices"] == 8
    wq = next(r for r in run["rows"] if r["name"] == "blocks/wq" and r["kind"] == "parameter")
    assert wq["spec"] == "P(pp, (tp,dp))" and wq["replicas"] == 1  # split over all 8
    tok = next(r for r in run["rows"] if r["name"] == "tok_embed" and r["kind"] == "parameter")
    assert tok["spec"] == "P(dp)" and tok["replicas"] == 4  # ZeRO-3's slice, whole over tp, pp


@pytest.mark.slow
def test_two_plans_show_what_differs(cli):
    out = cli("explain", "--strategy", "dp=2", "--strategy", "tp=2,precision=bf16",
              "--model", "tiny", "--json")
    a, b = out["plans"]
    assert a["totals"]["master weight"] == 0 < b["totals"]["master weight"]
    diff = {(d["kind"], d["slot"], d["name"]): d for d in out["differences"]}
    assert diff["master weight", None, "tok_embed"]["a"] is None  # fp32 has no master
    wq = diff["parameter", None, "blocks/wq"]
    assert wq["a"]["dtype"] == "float32" and wq["b"]["dtype"] == "bfloat16"
    assert wq["b"]["spec"] != wq["a"]["spec"]  # split over tp
    assert ("parameter", None, "ln_f/scale") in diff  # only its dtype changed
    assert all(k[0] != "counter" for k in diff)  # the counters are placed alike


def test_the_zero_flag_fires_on_a_copy_the_stage_should_split():
    row = {"kind": "optimizer slot", "mesh_axes": ["tp"]}  # split over tp, whole over dp
    assert "ZeRO-1 shards it over dp" in explain._unsharded(row, Plan(dp=4, zero_stage=1))
    assert explain._unsharded({**row, "mesh_axes": ["tp", "dp"]}, Plan(dp=4, zero_stage=1)) \
        is None
    assert explain._unsharded({**row, "kind": "parameter"}, Plan(dp=4, zero_stage=1)) is None
    assert explain._unsharded({**row, "kind": "parameter"}, Plan(dp=4, zero_stage=3))


@pytest.mark.slow
def test_gradient_rows_follow_the_layout_s_reduction(cli):
    """ZeRO-1 reduce-scatters once a step, so its micro-batch accumulator is whole; ZeRO-2
    every micro-batch, so the accumulator is already the dp slice; what both optimizers
    apply is the slot's slice. Gradients are not model state."""
    out = cli("explain", "--strategy", "dp=2,zero=1,micro_batches=2", "--strategy",
              "dp=2,zero=2,micro_batches=2", "--json")
    one, two = ({(r["kind"], r["name"]): r for r in p["rows"]} for p in out["plans"])
    for rows in (one, two):
        slot = rows["optimizer slot", "blocks/w1"]
        assert rows["reduced gradient", "blocks/w1"]["per_device_shape"] == \
            slot["per_device_shape"]
        assert rows["gradient", "blocks/w1"]["per_device_shape"] == \
            rows["parameter", "blocks/w1"]["per_device_shape"]
    assert one["accumulator", "blocks/w1"]["bytes_per_device"] == \
        2 * two["accumulator", "blocks/w1"]["bytes_per_device"]
    t = out["plans"][0]["totals"]
    assert t["model_state"] == t["parameter"] + t["master weight"] + t["optimizer slot"]
    assert t["gradient"] == t["parameter"] and t["reduced gradient"] * 2 == t["gradient"]


@pytest.mark.slow
def test_inside_the_step_comes_from_the_compiled_program(cli):
    """The peak buffers add up to XLA's own arguments; the saved activations fit in its
    temporaries (both from the same step: remat none keeps every residual)."""
    out = cli("explain", "--strategy", "dp=2,tp=2", "--json")
    ins = out["plans"][0]["inside"]
    assert ins["at_peak"]["argument"] == ins["memory"]["arguments"]
    assert 0 < ins["at_peak"]["temporary"] <= ins["memory"]["temporaries"]
    assert 0 < ins["activations"]["total"] <= ins["memory"]["temporaries"]
    assert ins["peak_buffers"] and all(b["kind"] == "temporary" for b in ins["peak_buffers"])


@pytest.mark.slow
def test_the_table_and_totals(cli):
    text = cli("explain", "--strategy", "dp=2,zero=1", "--model", "tiny")
    assert "every tensor of the training state" in text and "optimizer slot nu" in text
    assert "model state" in text and "warning" not in text
    assert "what backward keeps of one layer" in text and "largest buffers" in text


@pytest.mark.parametrize("argv, words", [
    (["--strategy", "dp=2", "--strategy", "tp=2", "--strategy", "dp=4"], ["3 times"]),
    (["--strategy", "dp=16"], ["'dp=16' needs 16 devices, got 8"]),
    (["--strategy", "dp=2", "--model", "7b"], ["7b"]),
    (["--strategy", "tp=3"], ["tp=3"]),
    (["--strategy", "dp=2", "--seq", "128"], ["--seq", "--target"]),
    (["--strategy", "dp=4,micro_batches=3", "--batch-size", "32"], ["32", "12"]),
    (["--strategy", "dp=2", "--target", "v9-4"], ["v9-4"]),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, words):
    from jaxscale.cli.main import main
    with pytest.raises(SystemExit) as e:
        main(["explain", *argv])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    assert all(w in err for w in words), err


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason='needs libtpu: pip install -e ".[tpu]"')
@pytest.mark.slow
def test_a_tpu_target_explained_from_this_machine(tmp_path):
    """--target v5e-4: the step compiled by XLA:TPU is compare --abstract's (the same
    memory figures); XLA:TPU keeps its buffer assignment back, so the peak's buffers come
    from its text dump."""
    import json

    from conftest import run_python
    main = "from jaxscale.cli.main import main; import sys; sys.exit(main(sys.argv[1:]))"
    args = ["--target", "v5e-4", "--model", "tiny-llama", "--strategy", "dp=4,zero=3"]
    explained = run_python(main, "explain", *args, "--json")
    assert explained.returncode == 0, explained.stderr
    compared = run_python(main, "compare", "--abstract", *args, "--out", str(tmp_path),
                          "--json")
    assert compared.returncode == 0, compared.stderr
    inside = json.loads(explained.stdout)["plans"][0]["inside"]
    assert inside["memory"] == json.loads(compared.stdout)["rows"][0]["memory"]
    assert inside["peak_buffers"] and inside["peak_buffers"][0]["shape"].startswith("f32[")
