"""Verification, clustering and scoring of candidate pairs (`jaxscale.data.dedup`), checked
against plain Python sets and a plain union-find. Pure numpy, a few seconds."""
from __future__ import annotations

import numpy as np
import pytest

from jaxscale.data import dedup
from jaxscale.data.shingles import jaccard, shingle_set


# --- helpers: references written the slow, obvious way ---------------------------------------

def union_find_labels(n: int, edges) -> list[int]:
    """Plain Python union-find; label = smallest index of the component."""
    parent = list(range(n))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in edges:
        ra, rb = find(int(a)), find(int(b))
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    return [find(x) for x in range(n)]


# --- 1. verify by exact Jaccard ---------------------------------------------------------------

def random_int_sets(rng, n: int, dtype, low: int, high: int) -> list[np.ndarray]:
    base = [rng.integers(low, high, size=int(rng.integers(0, 60)), dtype=np.int64) for _ in range(n)]
    out = []
    for i, s in enumerate(base):
        if i % 3 == 1:                                    # a near copy of the previous set
            s = np.concatenate([base[i - 1][: len(base[i - 1]) * 3 // 4], s[:5]])
        out.append(np.unique(s).astype(dtype))
    return out


@pytest.mark.parametrize("dtype,low,high", [
    (np.uint32, 0, 2 ** 32),                      # 32-bit shingle hashes: the common case
    (np.int64, -2 ** 62, 2 ** 62),                # spans too wide for doc*span: ranks are used
    (np.int64, -50, 50),                          # small, negative values, many overlaps
])
def test_verify_equals_python_set_jaccard(dtype, low, high):
    rng = np.random.default_rng(3)
    sets = random_int_sets(rng, 60, dtype, low, high)
    pairs = np.array([(i, j) for i in range(60) for j in range(i + 1, 60)])
    py = [set(s.tolist()) for s in sets]
    expected = np.array([jaccard(py[i], py[j]) for i, j in pairs])
    np.testing.assert_array_equal(dedup.jaccards(pairs, sets), expected)
    np.testing.assert_array_equal(dedup.jaccards(pairs, py), expected)   # Python sets path
    assert expected.max() > 0.5                   # some real near-duplicates in the mix
    for t in (0.0, 0.3, 0.5, 0.8, 1.0):
        np.testing.assert_array_equal(dedup.verify(pairs, sets, t), expected >= t)


def test_verify_on_shingle_sets_of_texts():
    words = "the quick brown fox jumps over the lazy dog and runs far away".split()
    texts = [" ".join(words), " ".join(words[:-1] + ["home"]), " ".join(reversed(words)), "",
             ""]
    sets = [shingle_set(t) for t in texts]
    pairs = np.array([[0, 1], [0, 2], [3, 4], [0, 3]])
    expected = [jaccard(sets[i], sets[j]) for i, j in pairs]
    assert expected == [8 / 10, 0.0, 1.0, 0.0]   # two empty documents count as identical
    np.testing.assert_array_equal(dedup.jaccards(pairs, sets), expected)
    assert dedup.verify(pairs, sets, 0.8).tolist() == [True, False, True, False]
    assert dedup.verify(np.empty((0, 2), np.int64), sets, 0.5).shape == (0,)


# --- 2. clusters and what is kept -------------------------------------------------------------

@pytest.mark.parametrize("n,m,seed", [(1, 0, 0), (10, 0, 1), (50, 30, 2), (200, 150, 3),
                                      (500, 1500, 4), (300, 290, 5)])
def test_clusters_equal_python_union_find(n, m, seed):
    rng = np.random.default_rng(seed)
    edges = rng.integers(0, n, size=(m, 2))               # self-loops and repeats included
    labels = dedup.clusters(n, edges)
    assert labels.dtype == np.int64 and labels.shape == (n,)
    assert labels.tolist() == union_find_labels(n, edges.tolist())


def test_clusters_on_a_long_chain_in_the_worst_order():
    n = 2000
    edges = np.stack([np.arange(n - 1, 0, -1), np.arange(n - 2, -1, -1)], axis=1)
    assert dedup.clusters(n, edges).tolist() == [0] * n
    perm = np.random.default_rng(0).permutation(n)        # the same chain, labels shuffled
    chain = np.stack([perm[:-1], perm[1:]], axis=1)
    assert dedup.clusters(n, chain).tolist() == [0] * n


def test_keep_mask_keeps_one_per_cluster_the_smallest():
    rng = np.random.default_rng(9)
    n = 400
    labels = dedup.clusters(n, rng.integers(0, n, size=(300, 2)))
    keep = dedup.keep_mask(labels)
    assert keep.dtype == bool
    assert keep.sum() == len(set(labels.tolist()))
    for lab in set(labels.tolist()):
        members = np.flatnonzero(labels == lab)
        assert keep[members].sum() == 1 and keep[members.min()]
    np.testing.assert_array_equal(keep, labels == np.arange(n))
    # any labelling: the first document carrying each label is kept
    assert dedup.keep_mask(np.array([7, 3, 7, 3, 5])).tolist() == [True, True, False, False, True]
    assert dedup.keep_mask(np.array([], np.int64)).shape == (0,)


# --- 3. scores --------------------------------------------------------------------------------

def test_pair_scores_hand_examples():
    s = dedup.pair_scores(np.array([[0, 1], [2, 3], [1, 0]]), np.array([[1, 0], [4, 5]]))
    assert s == {"precision": 0.5, "recall": 0.5, "f1": 0.5, "predicted": 2, "true": 2,
                 "true_positives": 1}
    s = dedup.pair_scores(np.array([[0, 1], [0, 2], [0, 3], [0, 4]]), np.array([[0, 1]]))
    assert (s["precision"], s["recall"], s["f1"]) == (0.25, 1.0, pytest.approx(0.4))
    s = dedup.pair_scores(np.empty((0, 2), np.int64), np.array([[0, 1]]))
    assert (s["precision"], s["recall"], s["f1"]) == (1.0, 0.0, 0.0)
    s = dedup.pair_scores(np.array([[2, 3]]), np.empty((0, 2), np.int64))
    assert (s["precision"], s["recall"], s["true_positives"]) == (0.0, 1.0, 0)
    with pytest.raises(ValueError, match=r"self-pair \(3, 3\)"):
        dedup.pair_scores(np.array([[3, 3]]), np.array([[0, 1]]))
