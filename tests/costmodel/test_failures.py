"""Failure and checkpoint formulas against lecture 13 §6 and exercise 9, by hand."""
import math

import pytest

from jaxscale.costmodel import failures as F
from jaxscale.costmodel import CostModelError

M_1024 = 50_000 / 1024 * 60  # minutes: 2929.6875


def test_cluster_mtbf_lecture_figures():
    """50,000 h per device: 6250 h on 8 devices, 48.8 h on 1024, 3.1 h on 16384."""
    assert F.cluster_mtbf(50_000, 8) == 6250
    assert round(F.cluster_mtbf(50_000, 1024), 1) == 48.8
    assert round(F.cluster_mtbf(50_000, 16384), 1) == 3.1
    assert round(F.cluster_mtbf(50_000, 1024) * 60) == 2930


def test_young_interval_and_waste_lecture_figures():
    """delta = 10 min, M = 2930 min: tau* = sqrt(2 x 10 x 2930) ~ 242 min, waste ~ 8.3%."""
    tau = F.young_interval(10, M_1024)
    assert tau == pytest.approx(math.sqrt(2 * 10 * 2929.6875))
    assert round(tau) == 242
    waste = F.first_order_waste(tau, 10, M_1024)
    assert waste == pytest.approx(10 / tau + tau / (2 * M_1024))
    assert waste == pytest.approx(math.sqrt(2 * 10 / M_1024))
    assert round(100 * waste, 1) == 8.3
    m16k = 50_000 / 16384 * 60
    assert round(100 * math.sqrt(2 * 10 / m16k)) == 33  # "about 33%" on 16384 devices
    assert round(100 * F.first_order_waste(F.young_interval(10, m16k), 10, m16k)) == 33


def test_young_interval_is_the_minimum_of_the_first_order_waste():
    tau = F.young_interval(10, M_1024)

    def w(t):
        return F.first_order_waste(t, 10, M_1024)
    assert w(tau) < w(tau * 0.99) and w(tau) < w(tau * 1.01)
    assert F.first_order_waste(tau, 10, M_1024, restart=30) == pytest.approx(w(tau) + 30 / M_1024)


def test_exercise_9_asynchronous_checkpoint():
    """delta down to 1 minute: tau* = sqrt(2 x 1 x 2930) ~ 77 min, waste sqrt(2/2930) ~ 2.6%."""
    p = F.checkpoint_plan(1024, 50_000 * 60, 10)
    a = p["async"]
    assert a["blocking"] == 1.0 and a["write"] == 10.0  # defaults: save / 10, and save
    assert round(a["interval"]) == round(math.sqrt(2 * 1 * 2929.6875)) == 77
    assert round(100 * a["waste_write_ignored"], 1) == round(100 * math.sqrt(2 / 2929.6875), 1) == 2.6
    # counting the background write: the restart point is one write older, + write / M
    assert a["waste_with_write"] == pytest.approx(math.sqrt(2 / M_1024) + 10 / M_1024)
    assert a["interval_covers_write"]
    assert round(p["young"]["interval"]) == 242 and round(p["cluster_mtbf"]) == 2930


def test_daly_interval_and_exact_waste():
    d, m = 10, M_1024
    x = d / (2 * m)
    assert F.daly_interval(d, m) == pytest.approx(math.sqrt(2 * d * m) * (1 + math.sqrt(x) / 3 + x / 9) - d)
    assert F.daly_interval(30, 10) == 10  # delta >= 2M: save every M
    tau, r = 200.0, 15.0
    hand = 1 - tau / (m * math.exp(r / m) * (math.exp((tau + d) / m) - 1))
    assert F.expected_waste(tau, d, m, r) == pytest.approx(hand)
    # Daly's interval is (numerically) where the exact waste is least
    daly = F.daly_interval(d, m)
    grid = [daly * (1 + k / 1000) for k in range(-200, 201)]
    best = min(grid, key=lambda t: F.expected_waste(t, d, m))
    assert abs(best - daly) / daly < 0.005
    # when delta << M the exact model and Young's first order agree
    big = 1e9
    t = F.young_interval(1, big)
    assert F.expected_waste(t, 1, big) == pytest.approx(F.first_order_waste(t, 1, big), rel=1e-3)


@pytest.mark.parametrize("call, words", [
    (lambda: F.cluster_mtbf(50_000, 0), "devices must be a finite number > 0, got 0"),
    (lambda: F.young_interval(-1, 100), "save must be a finite number > 0, got -1"),
    (lambda: F.first_order_waste(0, 10, 100), "interval must be"),
    (lambda: F.expected_waste(10, 1, 100, restart=-5), "restart must be a finite number >= 0"),
    (lambda: F.checkpoint_plan(8, 100, 10, async_blocking=0), "async_blocking must be"),
])
def test_bad_arguments(call, words):
    with pytest.raises(CostModelError, match=words):
        call()
