"""experiments.fp8: parts a, c and d (part b, training small, runs in its benchmark:
benchmarks/experiment_wall.py fp8)."""
import json

import pytest

from conftest import run_python


@pytest.mark.slow
def test_formats_outlier_and_bytes(tmp_path):
    r = run_python("import sys; from experiments.fp8 import main; sys.exit(main())",
                   "--parts", "acd", "--out", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    fmts = {x["format"]: x for x in res["a"]["rows"]}
    assert fmts["float8_e4m3fn"]["max"] == 448 and fmts["float8_e5m2"]["max"] == 57344
    assert fmts["float8_e4m3fn"]["mantissa_bits"] == 3 and fmts["float8_e5m2"]["mantissa_bits"] == 2

    c = {(x["outlier"], x["recipe"]): x for x in res["c"]["rows"]}
    # no outlier: the recipes agree (E4M3's own rounding, ~2.6% relative)
    assert c[(1, "fp8")]["other_channels_rel_error"] == pytest.approx(
        c[(1, "fp8-block")]["other_channels_rel_error"], rel=0.1)
    # a 1e5 outlier channel: one scale per tensor flushes much of the rest, per tile it does not
    assert c[(100_000, "fp8")]["flushed"] > 0.2 > 0.05 > c[(100_000, "fp8-block")]["flushed"]
    assert (c[(100_000, "fp8")]["other_channels_product_rel_error"]
            > 4 * c[(100_000, "fp8-block")]["other_channels_product_rel_error"])
    per_tensor = [c[(o, "fp8")]["subnormal"] for o in (1, 10, 100, 1_000, 10_000)]
    assert per_tensor == sorted(per_tensor)  # the larger the outlier, the more lose scale

    assert all(x["agrees"] and x["meets_budget"] for x in res["d"]["rows"])
    totals = {(x["policy"], x["moments"]): x["total_measured"] for x in res["d"]["rows"]}
    assert totals[("fp8", "fp32")] == 16 and totals[("fp8-block", "bf16")] == 12
    assert (tmp_path / "c_outlier.png").exists()
