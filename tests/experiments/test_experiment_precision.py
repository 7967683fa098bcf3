"""experiments.precision: parts a, b and e (the training parts run in the benchmark)."""
import json

import pytest

from conftest import run_python


@pytest.mark.slow
def test_formats_underflow_and_bytes(tmp_path):
    r = run_python("import sys; from experiments.precision import main; sys.exit(main())",
                   "--parts", "abe", "--out", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    a = res["a"]
    assert a["exact_integers"]["bfloat16"] == {"exact_through": 256, "first_inexact": 257,
                                               "first_inexact_becomes": 256.0}
    assert a["exact_integers"]["float16"]["exact_through"] == 2048
    assert a["near_one_bf16"] == {"1 + 2^-8": 1.0, "1 + 2^-7": 1.0078125}
    ones = a["sums"][0]
    assert ones["bfloat16"] == 256.0 and ones["float32"] == 10_000.0  # bf16 stalls at 2^8

    rows = {(x["gradients"], x["magnitude"], x["loss_scale"]): x for x in res["b"]["rows"]}
    small = [rows[("activation grads", "4096x batch", f"2^{k}")]["below_normal"]
             for k in (0, 8, 16, 24)]
    assert small[0] > 0.9 and small == sorted(small, reverse=True)  # scaling rescues them
    assert 0.01 < small[2] < 0.3  # the lecture: ~12% still below normal at 2^16
    assert all(abs(sum(x[k] for k in ("normal", "subnormal", "flushed_to_zero", "overflow")) - 1)
               < 1e-9 for x in res["b"]["rows"])

    assert all(x["agrees"] for x in res["e"]["rows"])
    totals = {x["policy"]: x["total_measured"] for x in res["e"]["rows"]}
    assert totals == {"fp32": 16, "bf16": 16, "fp16": 16, "bf16-pure": 8, "fp8": 16,
                      "fp8-delayed": 16, "fp8-block": 16,
                      "bf16, bf16 moments": 12}  # Adam's two moments at 2 bytes, not 4
