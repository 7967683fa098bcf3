"""compare's step-time prediction: the formula by hand, Spearman's rho, the rows it fills."""

import pytest

from jaxscale.compare import time_model as T
from jaxscale.model.flops import model_flops_per_token, recompute_flops_per_token
from jaxscale.model import config as model_config

CAL = {"flops_per_s": 1e11, "bytes_per_s": 2e9, "latency_s": 1e-4, "matmul_n": 512,
       "devices": 8, "platform": "cpu"}


def test_predicted_step_by_hand():
    cfg = model_config.preset("tiny")
    p = T.predicted_step(cfg, {"remat": "full"}, 32, 1e6, CAL, collectives=12)
    flops = 32 * cfg.seq_len * (model_flops_per_token(cfg).total
                                + recompute_flops_per_token(cfg, "full"))
    assert p["compute_s"] == pytest.approx(flops / 1e11)
    assert p["comm_s"] == pytest.approx(12 * 1e-4 + 1e6 / 2e9)
    assert p["step_s"] == pytest.approx(p["compute_s"] + p["comm_s"])
    one = T.predicted_step(cfg, {}, 32, 0.0, {**CAL, "bytes_per_s": None})
    assert one["comm_s"] == 0.0 and one["step_s"] == one["compute_s"]  # one device: no link
    assert T.predicted_step(cfg, {}, 32, 5.0, {**CAL, "bytes_per_s": None})["step_s"] is None


def test_on_accelerators_each_device_computes_its_share_ep_included():
    """Off the CPU the compute divides over every device of the plan: dp=2,ep=2 is four
    devices, as Plan.n_devices counts them (before: ep was left out, twice the time)."""
    cfg, gpu = model_config.preset("tiny"), {**CAL, "platform": "gpu"}
    whole = T.predicted_step(cfg, {}, 32, 0.0, gpu)["compute_s"]
    for plan in ({"dp": 4}, {"dp": 2, "ep": 2}, {"dp": 1, "ep": 2, "tp": 2}):
        assert T.predicted_step(cfg, plan, 32, 0.0, gpu)["compute_s"] == pytest.approx(whole / 4)


def test_spearman():
    assert T.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert T.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert T.spearman([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)
    assert T.spearman([1, 1, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486832980505138)
    assert T.spearman([1, 2], [2, 1]) is None and T.spearman([1, 1, 1], [1, 2, 3]) is None


def test_add_predictions_fills_rows_and_the_summary():
    rows = [{"name": n, "status": "ok", "plan": {"remat": "none"}, "n_devices": d,
             "step_s": s, "predicted": {"sent": {"all-reduce": b}} if b is not None else None,
             "sent_predicted_total": b, "calibration": CAL}
            for n, d, s, b in (("single", 1, 0.01, 0.0), ("dp", 8, 0.02, 4e6),
                               ("tp", 8, 0.05, 2e7), ("fp16", 8, 0.03, None))]
    rows.append({"name": "x", "status": "failed"})
    result = {"model": "tiny", "batch_size": 32, "rows": rows}
    T.add_predictions(result, model_config.preset("tiny"))
    assert "step_s_predicted" not in rows[3]  # bytes not modelled: no time either
    got = [r["step_s_predicted"] for r in rows[:3]]
    assert got[0] < got[1] < got[2]
    assert result["time_model"]["rows"] == 3 and result["time_model"]["rank_agreement"] == 1.0
    assert rows[1]["step_measured_over_predicted"] == pytest.approx(0.02 / got[1])
