"""Choosing LSH's bands and rows (`jaxscale.data.lsh_params`): the S-curve, its exact error
areas, and datasketch 2.0's choice of (b, r), reproduced. Pure numpy, a few seconds."""
from __future__ import annotations

import itertools
from fractions import Fraction
from math import comb

import numpy as np
import pytest

from jaxscale.data import lsh_params

datasketch = pytest.importorskip("datasketch")
from datasketch.lsh import _optimal_param  # noqa: E402  (the reference for optimal_params)
from scipy.integrate import quad  # noqa: E402  (datasketch's own quadrature needs scipy)


# --- 1. the S-curve ---------------------------------------------------------------------------

def test_lecture_values_from_the_formula_and_in_the_docstring():
    s = np.array([0.3, 0.5, 0.7])
    p = lsh_params.candidate_probability(s, bands=20, rows=5)
    naive = 1 - (1 - s ** 5) ** 20
    np.testing.assert_allclose(p, naive, rtol=1e-12)
    for si, pi in zip(s, p):
        # the module docstring quotes these; they must be what the formula gives
        assert f"{pi:.3f} at s = {si}" in lsh_params.__doc__, (si, pi)
    assert [round(float(x), 3) for x in p] == [0.047, 0.470, 0.975]
    assert f"t ~ {lsh_params.threshold_estimate(20, 5):.2f}" in lsh_params.__doc__
    assert lsh_params.candidate_probability(0.0, 20, 5) == 0.0
    assert lsh_params.candidate_probability(1.0, 20, 5) == 1.0
    assert isinstance(lsh_params.candidate_probability(0.5, 20, 5), float)


def test_candidate_probability_keeps_accuracy_where_it_is_tiny():
    # 1 - (1 - x)^b cancels for x ~ 1e-20; the expm1/log1p form gives b*x
    p = lsh_params.candidate_probability(1e-4, bands=3, rows=5)
    assert p == pytest.approx(3e-20, rel=1e-12)


# --- 2. areas and datasketch's choice of (b, r) -----------------------------------------------

def exact_fp_area(t: Fraction, b: int, r: int) -> Fraction:
    """integral_0^t 1 - (1 - s^r)^b ds by the binomial expansion, in exact rationals."""
    return sum((Fraction((-1) ** (j + 1) * comb(b, j)) * t ** (j * r + 1) / (j * r + 1)
                for j in range(1, b + 1)), Fraction(0))


@pytest.mark.parametrize("t,b,r", [(Fraction(1, 2), 3, 4), (Fraction(3, 10), 7, 2),
                                   (Fraction(9, 10), 5, 5), (Fraction(1, 10), 1, 1)])
def test_areas_are_exact(t, b, r):
    fp = lsh_params.false_positive_area(float(t), b, r)
    assert fp == pytest.approx(float(exact_fp_area(t, b, r)), rel=1e-13, abs=1e-16)
    # FN(t) = (1 - t) - integral_t^1 P, and integral_0^1 P = exact_fp_area(1)
    fn_exact = (1 - t) - (exact_fp_area(Fraction(1), b, r) - exact_fp_area(t, b, r))
    assert lsh_params.false_negative_area(float(t), b, r) == pytest.approx(float(fn_exact), rel=1e-12,
                                                                    abs=1e-16)


def test_areas_broadcast_and_agree_with_scipy_quad():
    b = np.array([[20], [64]])
    r = np.array([[1, 2, 4]])
    fp = lsh_params.false_positive_area(0.6, b, r)
    fn = lsh_params.false_negative_area(0.6, b, r)
    assert fp.shape == fn.shape == (2, 3)
    for i, j in itertools.product(range(2), range(3)):
        bb, rr = int(b[i, 0]), int(r[0, j])
        ref_fp = quad(lambda s: 1 - (1 - s ** rr) ** bb, 0, 0.6)[0]
        ref_fn = quad(lambda s: (1 - s ** rr) ** bb, 0.6, 1)[0]
        assert fp[i, j] == pytest.approx(ref_fp, abs=1e-10)
        assert fn[i, j] == pytest.approx(ref_fn, abs=1e-10)


@pytest.mark.parametrize("num_perm", [16, 64, 112, 128, 256])
def test_optimal_params_equal_datasketch(num_perm):
    for t in np.round(np.arange(0.1, 0.91, 0.1), 1):
        ours = lsh_params.optimal_params(float(t), num_perm)
        theirs = _optimal_param(float(t), num_perm, 0.5, 0.5)
        assert ours == theirs, (t, num_perm, ours, theirs)


def test_optimal_params_with_other_weights_equal_datasketch():
    for t, w in itertools.product((0.2, 0.5, 0.8), ((0.1, 0.9), (0.9, 0.1), (0.3, 0.7))):
        assert lsh_params.optimal_params(t, 64, w) == _optimal_param(t, 64, *w), (t, w)


# --- 3. parameter validation ------------------------------------------------------------------

def test_check_params_accepts_and_chooses():
    assert lsh_params.check_params(128, bands=16, rows=8) == (16, 8)
    assert lsh_params.check_params(128, bands=20, rows=5) == (20, 5)   # b*r < k allowed, like datasketch
    assert lsh_params.check_params(128, threshold=0.7) == _optimal_param(0.7, 128, 0.5, 0.5)
    assert lsh_params.check_params(64, threshold=0.7, weights=(0.9, 0.1)) == _optimal_param(0.7, 64,
                                                                                     0.9, 0.1)


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_perm=128, bands=20, rows=7), r"20 \* 7 = 140 exceeds num_perm = 128.*at most 18"),
    (dict(num_perm=128, bands=16), r"give both bands and rows.*rows=None"),
    (dict(num_perm=128), r"give both bands and rows"),
    (dict(num_perm=128, bands=16, rows=8, threshold=0.5), r"not both.*threshold=0.5"),
    (dict(num_perm=128, threshold=1.0), r"threshold must be a number in \(0, 1\), got 1.0"),
    (dict(num_perm=128, threshold=0.0), r"got 0.0"),
    (dict(num_perm=128, threshold="0.5"), r"got '0.5'"),
    (dict(num_perm=0, bands=1, rows=1), r"num_perm must be a positive integer, got 0"),
    (dict(num_perm=128, bands=2.0, rows=8), r"bands must be a positive integer, got 2.0"),
    (dict(num_perm=128, bands=4, rows=0), r"rows must be a positive integer, got 0"),
    (dict(num_perm=128, threshold=0.5, weights=(0.5, 0.6)), r"weights.*\(0.5, 0.6\)"),
])
def test_check_params_errors_name_the_bad_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        lsh_params.check_params(**kwargs)
