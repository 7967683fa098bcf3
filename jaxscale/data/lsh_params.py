"""Choosing the bands b and rows r of LSH: the S-curve, its threshold, and its error areas.

The banding trick (`lsh.py` does it). A MinHash signature has k = num_perm values, and for
any one of them P(two documents' values agree) = their Jaccard s. Cut the k values into b
bands of r consecutive rows (columns [i*r, (i+1)*r) make band i; any columns past b*r are left
unused, as datasketch does). Two documents become *candidates* when all r values of at least
one band agree. For one band, P(all r agree) = s^r; bands use disjoint hash functions, so they
are independent and

    P(candidate | Jaccard s) = 1 - (1 - s^r)^b.

As a function of s this is an S-curve: near 0 for small s, near 1 for large s, and steepest near
the threshold t ~ (1/b)^(1/r) (where one band's chance s^r reaches 1/b). The lecture's example,
b = 20, r = 5 (k = 100): t ~ 0.55, and P = 0.047 at s = 0.3, 0.470 at s = 0.5, 0.975 at s = 0.7
(`tests/test_data_lsh_params.py` computes these from the formula).

Choosing (b, r). Pairs below the threshold that become candidates are false positives, pairs above
it that do not are false negatives. Their "areas" under the curve,

    FP(t) = integral_0^t  1 - (1 - s^r)^b  ds,      FN(t) = integral_t^1  (1 - s^r)^b  ds,

are what datasketch minimises (weighted, over all b*r <= k) to pick (b, r) for a threshold:
`optimal_params` reproduces its choice. Both integrands are polynomials in s of degree b*r, so
Gauss-Legendre quadrature with n >= (b*r + 1)/2 nodes integrates them exactly (up to rounding);
no scipy needed. `check_params` validates a choice given either way. Pure numpy, no JAX.
"""
from __future__ import annotations

import functools
from typing import Sequence

import numpy as np

from jaxscale.data.arrays import positive_int


# ---------------------------------------------------------------------------------------------
# 1. The S-curve and the threshold.

def candidate_probability(s, bands: int, rows: int) -> np.ndarray | float:
    """P(two documents of Jaccard s become candidates) = 1 - (1 - s^r)^b.

    Computed as -expm1(b * log1p(-s^r)), which keeps its accuracy where the answer is tiny
    (small s, where 1 - (1 - x)^b would cancel). `s` may be a scalar or an array in [0, 1].
    """
    s_arr = np.asarray(s, dtype=np.float64)
    with np.errstate(divide="ignore"):  # s = 1 gives log1p(-1) = -inf, and -expm1(-inf) = 1
        p = -np.expm1(bands * np.log1p(-(s_arr ** rows)))
    return float(p) if p.ndim == 0 else p


def threshold_estimate(bands: int, rows: int) -> float:
    """(1/b)^(1/r): the Jaccard where one band's chance s^r equals 1/b, near the curve's step."""
    return (1.0 / bands) ** (1.0 / rows)


# ---------------------------------------------------------------------------------------------
# 2. The false positive / false negative areas, exactly, and datasketch's choice of (b, r).

def _gauss_legendre_area(lo: float, hi: float, bands: np.ndarray, rows: np.ndarray,
                         negative: bool, degree: int | None = None) -> np.ndarray:
    """integral_lo^hi of P(s) (or of 1 - P(s) if `negative`) for arrays of (b, r), exactly.

    The integrand is a polynomial of degree b*r; n Gauss-Legendre nodes are exact for degree
    2n - 1, so n = degree // 2 + 1 nodes (degree: at least max(b*r)) are exact for every
    pair at once.
    """
    bands = np.asarray(bands, dtype=np.float64)
    rows = np.asarray(rows, dtype=np.float64)
    degree = int(np.max(bands * rows)) if degree is None else degree
    x, w = _leggauss(degree // 2 + 1)                       # nodes and weights on [-1, 1]
    s = 0.5 * (hi - lo) * x + 0.5 * (hi + lo)                # mapped onto [lo, hi]
    w = 0.5 * (hi - lo) * w
    miss = (1.0 - s[:, None] ** rows.ravel()[None, :]) ** bands.ravel()[None, :]  # (1-s^r)^b
    integrand = miss if negative else 1.0 - miss
    return (w @ integrand).reshape(bands.shape)


@functools.lru_cache(maxsize=4)
def _leggauss(n: int) -> tuple[np.ndarray, np.ndarray]:
    """n Gauss-Legendre nodes and weights (numpy's eigenvalue method: 0.25 s at n = 513,
    3.4 s at 1025, so num_perm is capped at MAX_NUM_PERM)."""
    return np.polynomial.legendre.leggauss(n)


def _check_threshold(threshold: float) -> float:
    if not (isinstance(threshold, (int, float, np.floating, np.integer))
            and 0.0 < float(threshold) < 1.0):
        raise ValueError(f"threshold must be a number in (0, 1), got {threshold!r}")
    return float(threshold)


def false_positive_area(threshold: float, bands, rows) -> np.ndarray | float:
    """integral_0^t 1 - (1 - s^r)^b ds: how much of the curve lies below the threshold.

    `bands` and `rows` may be arrays (broadcast together), giving one area per pair.
    """
    t = _check_threshold(threshold)
    b, r = np.broadcast_arrays(np.asarray(bands), np.asarray(rows))
    area = _gauss_legendre_area(0.0, t, b, r, negative=False)
    return float(area) if area.ndim == 0 else area


def false_negative_area(threshold: float, bands, rows) -> np.ndarray | float:
    """integral_t^1 (1 - s^r)^b ds: how much of the curve is missing above the threshold."""
    t = _check_threshold(threshold)
    b, r = np.broadcast_arrays(np.asarray(bands), np.asarray(rows))
    area = _gauss_legendre_area(t, 1.0, b, r, negative=True)
    return float(area) if area.ndim == 0 else area


def _check_weights(weights: Sequence[float]) -> tuple[float, float]:
    w = tuple(float(x) for x in weights)
    if len(w) != 2 or any(not (0.0 <= x <= 1.0) for x in w) or abs(sum(w) - 1.0) > 1e-12:
        raise ValueError(f"weights must be two numbers in [0, 1] summing to 1 "
                         f"(false positive, false negative), got {tuple(weights)!r}")
    return w


MAX_NUM_PERM = 1024  # the most permutations optimal_params takes (its quadrature's cost)


def optimal_params(threshold: float, num_perm: int,
                   weights: Sequence[float] = (0.5, 0.5)) -> tuple[int, int]:
    """The (bands, rows), b*r <= num_perm, minimising w_fp * FP(t) + w_fn * FN(t).

    Same search as datasketch's `MinHashLSH(threshold=...)`: every b in 1..k with every
    r in 1..floor(k/b), in that order, the first strict minimum winning ties. datasketch
    integrates with scipy's adaptive quadrature (error ~1e-10); we integrate exactly, so on a
    near-tie the two could in principle differ; the test checks they agree on a grid.
    """
    t = _check_threshold(threshold)
    k = positive_int("num_perm", num_perm)
    if k > MAX_NUM_PERM:
        raise ValueError(f"num_perm must be at most {MAX_NUM_PERM} to choose bands and rows "
                         f"from a threshold, got {k}; give bands and rows instead")
    w_fp, w_fn = _check_weights(weights)
    best, best_error = (0, 0), np.inf
    for b in range(1, k + 1):  # one band count at a time: memory O(nodes x k/b)
        r = np.arange(1, k // b + 1)
        bb = np.full(len(r), b)
        error = (w_fp * _gauss_legendre_area(0.0, t, bb, r, negative=False, degree=k)
                 + w_fn * _gauss_legendre_area(t, 1.0, bb, r, negative=True, degree=k))
        i = int(np.argmin(error))  # the first minimum, like datasketch's loop
        if error[i] < best_error:
            best, best_error = (b, int(r[i])), float(error[i])
    return best


def check_params(num_perm: int, bands: int | None = None, rows: int | None = None,
                 threshold: float | None = None,
                 weights: Sequence[float] = (0.5, 0.5)) -> tuple[int, int]:
    """Validate a banding choice and return (bands, rows).

    Give exactly one of: both `bands` and `rows`, or a `threshold` in (0, 1) (then
    `optimal_params(threshold, num_perm, weights)` chooses). We require bands * rows <= num_perm,
    like datasketch, not equality: the columns past b*r are simply unused. (datasketch's index
    also refuses b < 2; a single band is allowed here, it is just an exact-match on r values.)
    """
    k = positive_int("num_perm", num_perm)
    given_pair = bands is not None or rows is not None
    if given_pair and threshold is not None:
        raise ValueError(f"give either (bands, rows) or threshold, not both: got bands={bands!r}, "
                         f"rows={rows!r}, threshold={threshold!r}")
    if threshold is not None:
        return optimal_params(threshold, k, weights)
    if bands is None or rows is None:
        raise ValueError(f"give both bands and rows (or a threshold instead): got bands={bands!r}, "
                         f"rows={rows!r}")
    b = positive_int("bands", bands)
    r = positive_int("rows", rows)
    if b * r > k:
        fits = [bb for bb in range(1, k + 1) if bb * r <= k]
        raise ValueError(f"bands * rows = {b} * {r} = {b * r} exceeds num_perm = {k}: with rows={r} "
                         f"bands can be at most {max(fits) if fits else 0}; with bands={b} "
                         f"rows can be at most {k // b}")
    return b, r
