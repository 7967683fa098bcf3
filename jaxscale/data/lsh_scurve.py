"""The S-curve measured: how often banding makes candidates of pairs of known Jaccard.

For pairs whose exact Jaccard s is known, `banded_match` says which of them agree on all r rows
of some band (would become LSH candidates), and `s_curve` bins the pairs by s and sets the
measured rate beside the formula 1 - (1 - s^r)^b (`lsh_params.candidate_probability`), with the
binomial standard error that tells a real departure from chance. Pure numpy, no JAX.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxscale.data.arrays import as_pairs, as_signatures
from jaxscale.data.lsh_params import candidate_probability, check_params


class SCurveRow(NamedTuple):
    """One Jaccard bin of `s_curve`: the measured candidate rate beside the formula's."""
    lo: float
    hi: float
    pairs: int
    measured: float           # fraction of the bin's pairs that agree on all rows of some band
    predicted_at_mean: float  # 1 - (1 - s^r)^b at the bin's mean Jaccard
    predicted_mean: float     # mean over the bin's pairs of 1 - (1 - s^r)^b (what `measured`
    #                           estimates: each pair is an independent Bernoulli trial)
    stderr: float             # sqrt(sum p_i (1 - p_i)) / pairs: the standard error of `measured`


def banded_match(signatures: np.ndarray, pairs: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """For each pair: do the two signatures agree on all r rows of at least one band?"""
    sig = as_signatures(signatures)
    b, r = check_params(sig.shape[1], bands, rows)
    p = as_pairs(pairs, sig.shape[0])
    same = sig[p[:, 0], :b * r] == sig[p[:, 1], :b * r]
    return same.reshape(len(p), b, r).all(axis=2).any(axis=1)


def s_curve(signatures: np.ndarray, pairs: np.ndarray, jaccards: np.ndarray, bands: int,
            rows: int, bins: np.ndarray | None = None) -> list[SCurveRow]:
    """The S-curve measured: for pairs of known exact Jaccard, per Jaccard bin, the fraction
    that banding makes candidates, beside 1 - (1 - s^r)^b.

    Bins are [lo, hi) except the last, [lo, hi]; an empty bin's rates are nan. With s_i the
    bin's Jaccards, `measured` is a mean of independent Bernoulli(p_i = P(s_i)) trials, so it
    should lie within a few `stderr` of `predicted_mean`.
    """
    edges = np.linspace(0.0, 1.0, 11) if bins is None else np.asarray(bins, dtype=np.float64)
    if edges.ndim != 1 or edges.size < 2 or np.any(np.diff(edges) <= 0):
        raise ValueError(f"bins must be increasing bin edges, got {edges!r}")
    s = np.asarray(jaccards, dtype=np.float64)
    p = as_pairs(pairs)
    if s.shape != (len(p),):
        raise ValueError(f"jaccards must have one value per pair: {len(p)} pairs, got shape "
                         f"{s.shape}")
    outside = (s < edges[0]) | (s > edges[-1])
    if outside.any():
        raise ValueError(f"jaccard {s[outside][0]} lies outside the bins "
                         f"[{edges[0]}, {edges[-1]}]")
    hit = banded_match(signatures, p, bands, rows)
    prob = candidate_probability(s, bands, rows)
    which = np.clip(np.searchsorted(edges, s, side="right") - 1, 0, edges.size - 2)
    rows_out = []
    for k in range(edges.size - 1):
        m = which == k
        c = int(m.sum())
        if c:
            pk = prob[m]
            row = SCurveRow(float(edges[k]), float(edges[k + 1]), c, float(hit[m].mean()),
                            float(candidate_probability(s[m].mean(), bands, rows)),
                            float(pk.mean()), float(np.sqrt(np.sum(pk * (1 - pk))) / c))
        else:
            row = SCurveRow(float(edges[k]), float(edges[k + 1]), 0, *([float("nan")] * 4))
        rows_out.append(row)
    return rows_out
