"""compare --precision: every strategy, the single device and the control in one policy,
each judged against its own single-device run (the fp8 policy here)."""
import pytest


@pytest.mark.slow
def test_fp8_strategies_follow_their_own_single_device(cli, tmp_path):
    out = cli("compare", "--model", "tiny", "--precision", "fp8", "--strategies",
              "dp,tp,zero3", "--strategy", "dp=2,precision=bf16", "--steps", "3",
              "--repeats", "3", "--out", str(tmp_path), "--json")
    plans = {r["name"]: r["plan"]["precision"] for r in out["rows"]}
    assert plans == {"single": "fp8", "control": "fp8", "dp": "fp8", "tp": "fp8",
                     "zero3": "fp8", "dp=2,precision=bf16": "bf16"}  # a layout's own stays
    rows = {r["name"]: r for r in out["rows"]}
    assert all(rows[n]["pass"] for n in ("dp", "tp", "zero3")), out["noise"]
    assert out["noise"]["drift"] > 0  # the fp8 control: the same policy, another order


def test_tracing_under_a_low_precision_needs_a_tolerance(fail):
    err = fail("compare", "--precision", "fp8", "--trace-divergence")
    assert "--tolerance" in err and "fp8" in err
