"""From LSH's candidate pairs to the documents kept: exact verification, union-find, scores.

LSH (`lsh.py`) proposes pairs that agree on some band of their signatures; most are true
near-duplicates, some are chance agreements. Here, one step after another:
  1. `verify`       keep a pair only if the exact Jaccard of the two shingle sets (sorted
                    unique integer arrays, e.g. `shingles.shingle_ids`, or Python sets)
                    reaches the threshold (`jaccards` gives the values);
  2. `clusters`     connected components of the kept pairs by vectorised union-find, each
                    labelled by its smallest index; `keep_mask` keeps that document;
  3. `pair_scores`  precision, recall and F1 of predicted pairs against true ones.
Pure numpy; none of it needs JAX.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxscale.data.arrays import as_pairs


# ---------------------------------------------------------------------------------------------
# 1. Verify candidates by exact Jaccard of the shingle sets.

def _flatten_arrays(sets: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray, int]:
    """Sorted-unique integer arrays -> (codes, offsets, span), the codes globally sorted.

    code = document * span + (value - min) increases along the concatenation (each array is
    sorted and unique), so one searchsorted over all documents finds any (document, value). If
    that would not fit int64, values are first replaced by their ranks (order-preserving).
    """
    lengths = np.fromiter((len(x) for x in sets), dtype=np.int64, count=len(sets))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    if offsets[-1] == 0:
        return np.empty(0, np.int64), offsets, 1
    flat = np.concatenate([np.asarray(x) for x in sets if len(x)])
    if not np.issubdtype(flat.dtype, np.integer):
        raise ValueError(f"set arrays must hold integers, got dtype {flat.dtype}")
    doc = np.repeat(np.arange(len(sets), dtype=np.int64), lengths)
    bad = (doc[1:] == doc[:-1]) & (flat[1:] <= flat[:-1])
    if bad.any():
        raise ValueError(f"the set array of document {int(doc[1:][bad][0])} is not sorted and "
                         f"unique: pass np.unique(values)")
    lo, hi = int(flat.min()), int(flat.max())
    span = hi - lo + 1
    if len(sets) * span < 2 ** 62:
        values = (flat - lo).astype(np.int64) if lo >= 0 else flat.astype(np.int64) - lo
    else:
        _, values = np.unique(flat, return_inverse=True)
        span = int(values.max()) + 1
    return doc * span + values.astype(np.int64), offsets, span


def _intersections_arrays(pairs: np.ndarray, codes: np.ndarray, offsets: np.ndarray,
                          span: int) -> np.ndarray:
    """|A_i & A_j| for every pair, searching the smaller set's elements in the larger set."""
    lengths = np.diff(offsets)
    i, j = pairs[:, 0], pairs[:, 1]
    small = np.where(lengths[i] <= lengths[j], i, j)
    large = np.where(lengths[i] <= lengths[j], j, i)
    counts = lengths[small]
    total = int(counts.sum())
    if total == 0:
        return np.zeros(len(pairs), np.int64)
    restart = np.cumsum(counts) - counts
    element = np.repeat(offsets[small], counts) + (np.arange(total) - np.repeat(restart, counts))
    value = codes[element] - np.repeat(small, counts) * span   # back to this document's value
    target = np.repeat(large, counts) * span + value
    at = np.searchsorted(codes, target)
    found = (at < codes.size) & (codes[np.minimum(at, codes.size - 1)] == target)
    pair_of = np.repeat(np.arange(len(pairs)), counts)
    return np.bincount(pair_of, weights=found, minlength=len(pairs)).astype(np.int64)


def jaccards(pairs: np.ndarray, sets: Sequence) -> np.ndarray:
    """Exact Jaccard |A & B| / |A | B| of each pair's two sets, float64 (two empty sets: 1.0).

    `sets[i]` is document i's shingle set: either a Python set / frozenset (any hashable
    elements, computed pair by pair) or a sorted unique integer numpy array, e.g. the shingles'
    32-bit hashes (the common case, vectorised: each element of the smaller set is looked up
    in the larger one by one searchsorted over all documents at once).
    """
    p = as_pairs(pairs, len(sets))
    if len(p) == 0:
        return np.empty(0, np.float64)
    if all(isinstance(x, np.ndarray) for x in sets):
        codes, offsets, span = _flatten_arrays(sets)
        lengths = np.diff(offsets)
        inter = _intersections_arrays(p, codes, offsets, span)
        union = lengths[p[:, 0]] + lengths[p[:, 1]] - inter
    else:
        as_sets = [x if isinstance(x, (set, frozenset)) else set(x.tolist()
                   if isinstance(x, np.ndarray) else x) for x in sets]
        inter = np.fromiter((len(as_sets[a] & as_sets[b]) for a, b in p), np.int64, len(p))
        union = np.fromiter((len(as_sets[a]) + len(as_sets[b]) for a, b in p), np.int64,
                            len(p)) - inter
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(union > 0, inter / np.maximum(union, 1), 1.0)


def verify(pairs: np.ndarray, sets: Sequence, threshold: float) -> np.ndarray:
    """Boolean mask over `pairs`: exact Jaccard of the two documents' sets >= threshold."""
    t = float(threshold)
    if not 0.0 <= t <= 1.0:
        raise ValueError(f"threshold must be in [0, 1], got {threshold!r}")
    return jaccards(pairs, sets) >= t


# ---------------------------------------------------------------------------------------------
# 2. Connected components: which documents are copies of each other.

def clusters(n: int, edges: np.ndarray) -> np.ndarray:
    """Connected components of the graph on 0..n-1 with these edges: [n] int64 labels, each
    document's label the smallest index in its cluster.

    Union-find, vectorised over all edges at once. Every round:
      - hook: for each edge whose endpoints have different roots, the larger root is pointed at
        the smaller (np.minimum.at, so a root linked to several takes the smallest);
      - compress: pointer jumping, parent <- parent[parent], until every node points at a root.
    Edges that have become internal are dropped, and the rounds stop when none remain. Hooking
    larger-to-smaller (instead of union by size/rank) keeps parent[x] <= x, so no cycle can form
    and each root is its cluster's smallest index: the label we want, for free. Full compression
    every round plays the part of path compression; a round costs O(n + live edges), and the
    number of rounds grows like log of the longest chain of roots (a few, on dedup graphs).
    """
    n = _check_nonnegative_int("n", n)
    e = as_pairs(edges, n, "edges")
    parent = np.arange(n, dtype=np.int64)
    u, v = e[:, 0], e[:, 1]
    while u.size:
        ru, rv = parent[u], parent[v]
        live = ru != rv
        if not live.any():
            break
        u, v, ru, rv = u[live], v[live], ru[live], rv[live]
        np.minimum.at(parent, np.maximum(ru, rv), np.minimum(ru, rv))
        while True:
            grand = parent[parent]
            if np.array_equal(grand, parent):
                break
            parent = grand
    return parent


def _check_nonnegative_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


def keep_mask(labels: np.ndarray) -> np.ndarray:
    """Keep one document per cluster, the first (smallest index) carrying each label.

    With `clusters`' labels that is exactly labels == arange(n); written as "first occurrence"
    it also works for any other labelling.
    """
    lab = np.asarray(labels)
    if lab.ndim != 1:
        raise ValueError(f"labels must be a 1-D array, got shape {lab.shape}")
    mask = np.zeros(lab.shape[0], dtype=bool)
    if lab.size:
        _, first = np.unique(lab, return_index=True)
        mask[first] = True
    return mask


# ---------------------------------------------------------------------------------------------
# 3. Measuring: precision / recall of predicted pairs against true ones.

def _pair_codes(pairs: np.ndarray, n: int, name: str) -> np.ndarray:
    p = as_pairs(pairs, None, name)
    if np.any(p[:, 0] == p[:, 1]):
        i = int(p[p[:, 0] == p[:, 1], 0][0])
        raise ValueError(f"{name} holds the self-pair ({i}, {i}); a pair is two documents")
    return np.unique(np.minimum(p[:, 0], p[:, 1]) * n + np.maximum(p[:, 0], p[:, 1]))


def pair_scores(predicted_pairs: np.ndarray, true_pairs: np.ndarray) -> dict[str, float | int]:
    """Precision, recall and F1 of predicted against true duplicate pairs (unordered, deduped).

    precision = TP / predicted, recall = TP / true, F1 their harmonic mean. Conventions for the
    empty cases: no predictions -> precision 1.0 (nothing wrong was claimed); no true pairs ->
    recall 1.0 (nothing was missed); F1 = 0.0 when precision + recall = 0.
    """
    pred = np.asarray(predicted_pairs)
    true = np.asarray(true_pairs)
    n = 1 + max(int(pred.max()) if pred.size else 0, int(true.max()) if true.size else 0)
    pc = _pair_codes(pred, n, "predicted_pairs")
    tc = _pair_codes(true, n, "true_pairs")
    tp = int(np.intersect1d(pc, tc, assume_unique=True).size)
    precision = tp / pc.size if pc.size else 1.0
    recall = tp / tc.size if tc.size else 1.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1,
            "predicted": int(pc.size), "true": int(tc.size), "true_positives": tp}
