"""experiments.pipeline_bubble in a fresh process (it forces 8 devices): both parts."""
import json

import pytest

from conftest import fp32_sum_bound, run_python


@pytest.mark.slow
def test_six_schedules_simulated_and_executed(tmp_path):
    r = run_python("import runpy, sys; sys.argv[0] = 'x'; "
                   "runpy.run_module('experiments.pipeline_bubble', run_name='__main__')",
                   "--out", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    curves = res["a"]["curves"]
    for name, curve in curves.items():
        assert all(c["equal"] for c in curve), name  # simulator = closed form, every m
        assert all(c["cost_model"] == pytest.approx(c["idle"], rel=1e-12) for c in curve), name
    for p in (4, 8):  # at every m both run: 1F1B > ZB-H1 = ZB-H2 > ZB-V, memory as stated
        at = {n.split()[0]: {c["m"]: c for c in cv} for n, cv in curves.items()
              if n.endswith(f"p={p}")}
        m = 2 * p
        assert at["1f1b"][m]["idle"] > at["zb-h1"][m]["idle"] == at["zb-h2"][m]["idle"] > \
            at["zbv"][m]["idle"]
        assert at["zb-h1"][m]["peak_stages"] == at["zbv"][m]["peak_stages"] == p
        assert at["zb-h2"][m]["peak_stages"] == 2 * p
    bound = fp32_sum_bound(682)  # target tokens of the batch: regrouped fp32 sums only
    for run in res["b"]["runs"]:
        assert run["max_rel_grad_diff"] <= bound and run["loss_rel_diff"] <= bound, run
        assert run["idle_executed"] == pytest.approx(run["idle_simulated"], abs=1e-12)
    assert len(res["b"]["runs"]) == 9 and (tmp_path / "bubble.png").stat().st_size > 10_000
