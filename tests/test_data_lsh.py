"""LSH banding and clustering (`jaxscale.data.lsh`), checked against datasketch 2.0 and plain
Python references. Pure numpy: no JAX compilation, the whole file runs in a few seconds."""
from __future__ import annotations

import itertools
from fractions import Fraction
from math import comb

import numpy as np
import pytest

from jaxscale.data import dedup, lsh
from jaxscale.data.shingles import jaccard, shingle_set

datasketch = pytest.importorskip("datasketch")
from datasketch.lsh import _optimal_param  # noqa: E402  (the reference for optimal_params)


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


def datasketch_signatures(sets: list[list[bytes]], num_perm: int, seed: int = 1) -> np.ndarray:
    rows = []
    for s in sets:
        m = datasketch.MinHash(num_perm=num_perm, seed=seed)
        m.update_batch(s)
        rows.append(m.hashvalues)
    return np.array(rows, dtype=np.uint32)


def overlapping_pair(rng: np.random.Generator, tag: int, size: int, shared: int):
    """Two sets of `size` byte strings sharing exactly `shared`: Jaccard shared/(2 size - shared)."""
    common = [b"c%d-%d" % (tag, i) for i in range(shared)]
    a = common + [b"a%d-%d" % (tag, i) for i in range(size - shared)]
    b = common + [b"b%d-%d" % (tag, i) for i in range(size - shared)]
    return a, b


# --- 1. the S-curve ---------------------------------------------------------------------------

def test_lecture_values_from_the_formula_and_in_the_docstring():
    s = np.array([0.3, 0.5, 0.7])
    p = lsh.candidate_probability(s, bands=20, rows=5)
    naive = 1 - (1 - s ** 5) ** 20
    np.testing.assert_allclose(p, naive, rtol=1e-12)
    for si, pi in zip(s, p):
        # the module docstring quotes these; they must be what the formula gives
        assert f"{pi:.3f} at s = {si}" in lsh.__doc__, (si, pi)
    assert [round(float(x), 3) for x in p] == [0.047, 0.470, 0.975]
    assert f"t ~ {lsh.threshold_estimate(20, 5):.2f}" in lsh.__doc__
    assert lsh.candidate_probability(0.0, 20, 5) == 0.0
    assert lsh.candidate_probability(1.0, 20, 5) == 1.0
    assert isinstance(lsh.candidate_probability(0.5, 20, 5), float)


def test_candidate_probability_keeps_accuracy_where_it_is_tiny():
    # 1 - (1 - x)^b cancels for x ~ 1e-20; the expm1/log1p form gives b*x
    p = lsh.candidate_probability(1e-4, bands=3, rows=5)
    assert p == pytest.approx(3e-20, rel=1e-12)


# --- 2. areas and datasketch's choice of (b, r) -----------------------------------------------

def exact_fp_area(t: Fraction, b: int, r: int) -> Fraction:
    """integral_0^t 1 - (1 - s^r)^b ds by the binomial expansion, in exact rationals."""
    return sum((Fraction((-1) ** (j + 1) * comb(b, j)) * t ** (j * r + 1) / (j * r + 1)
                for j in range(1, b + 1)), Fraction(0))


@pytest.mark.parametrize("t,b,r", [(Fraction(1, 2), 3, 4), (Fraction(3, 10), 7, 2),
                                   (Fraction(9, 10), 5, 5), (Fraction(1, 10), 1, 1)])
def test_areas_are_exact(t, b, r):
    fp = lsh.false_positive_area(float(t), b, r)
    assert fp == pytest.approx(float(exact_fp_area(t, b, r)), rel=1e-13, abs=1e-16)
    # FN(t) = (1 - t) - integral_t^1 P, and integral_0^1 P = exact_fp_area(1)
    fn_exact = (1 - t) - (exact_fp_area(Fraction(1), b, r) - exact_fp_area(t, b, r))
    assert lsh.false_negative_area(float(t), b, r) == pytest.approx(float(fn_exact), rel=1e-12,
                                                                    abs=1e-16)


def test_areas_broadcast_and_agree_with_scipy_quad():
    from scipy.integrate import quad
    b = np.array([[20], [64]])
    r = np.array([[1, 2, 4]])
    fp = lsh.false_positive_area(0.6, b, r)
    fn = lsh.false_negative_area(0.6, b, r)
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
        ours = lsh.optimal_params(float(t), num_perm)
        theirs = _optimal_param(float(t), num_perm, 0.5, 0.5)
        assert ours == theirs, (t, num_perm, ours, theirs)


def test_optimal_params_with_other_weights_equal_datasketch():
    for t, w in itertools.product((0.2, 0.5, 0.8), ((0.1, 0.9), (0.9, 0.1), (0.3, 0.7))):
        assert lsh.optimal_params(t, 64, w) == _optimal_param(t, 64, *w), (t, w)


# --- 3. parameter validation ------------------------------------------------------------------

def test_check_params_accepts_and_chooses():
    assert lsh.check_params(128, bands=16, rows=8) == (16, 8)
    assert lsh.check_params(128, bands=20, rows=5) == (20, 5)   # b*r < k allowed, like datasketch
    assert lsh.check_params(128, threshold=0.7) == _optimal_param(0.7, 128, 0.5, 0.5)
    assert lsh.check_params(64, threshold=0.7, weights=(0.9, 0.1)) == _optimal_param(0.7, 64,
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
        lsh.check_params(**kwargs)


def test_bad_arrays_are_refused_by_name():
    with pytest.raises(ValueError, match=r"2-D array.*shape \(5,\)"):
        lsh.band_keys(np.zeros(5, np.uint32), 1, 1)
    with pytest.raises(ValueError, match=r"dtype float64"):
        lsh.band_keys(np.zeros((2, 4)), 2, 2)
    with pytest.raises(ValueError, match=r"fit in uint32.*\[-1, 0\]"):
        lsh.band_keys(np.array([[0, -1]]), 1, 2)
    with pytest.raises(ValueError, match=r"8 \* 2 = 16 exceeds num_perm = 8"):
        lsh.band_keys(np.zeros((2, 8), np.uint32), 8, 2)
    with pytest.raises(ValueError, match=r"method must be 'hash' or 'exact', got 'fast'"):
        lsh.band_keys(np.zeros((2, 8), np.uint32), 2, 2, method="fast")
    with pytest.raises(ValueError, match=r"keys must be a 2-D array"):
        lsh.candidate_pairs(np.zeros(3, np.uint64))
    with pytest.raises(ValueError, match=r"document index 7, valid indices are 0..2"):
        dedup.verify(np.array([[0, 7]]), [np.arange(3)] * 3, 0.5)
    with pytest.raises(ValueError, match=r"edges holds document index -1"):
        dedup.clusters(3, np.array([[0, -1]]))
    with pytest.raises(ValueError, match=r"threshold must be in \[0, 1\], got 1.5"):
        dedup.verify(np.array([[0, 1]]), [np.arange(3)] * 2, 1.5)
    with pytest.raises(ValueError, match=r"document 1 is not sorted and unique"):
        dedup.verify(np.array([[0, 1]]), [np.arange(3), np.array([3, 1])], 0.5)
    with pytest.raises(ValueError, match=r"n must be a non-negative integer, got -1"):
        dedup.clusters(-1, np.empty((0, 2), np.int64))


# --- 4. band keys -----------------------------------------------------------------------------

def partition(column: np.ndarray) -> set[frozenset[int]]:
    groups: dict = {}
    for i, v in enumerate(column.tolist() if column.ndim == 1 else map(tuple, column.tolist())):
        groups.setdefault(v, set()).add(i)
    return {frozenset(g) for g in groups.values()}


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5])
def test_band_keys_group_exactly_the_identical_bands(rows):
    rng = np.random.default_rng(rows)
    bands, n = 6, 400
    # a tiny alphabet, so most bands repeat (2^rows distinct contents), plus big values
    sig = rng.integers(0, 2, size=(n, bands * rows + 3), dtype=np.uint32)
    sig[::7] *= np.uint32(0xFFFFFFFF)
    for method in ("hash", "exact"):
        keys = lsh.band_keys(sig, bands, rows, method=method)
        assert keys.shape == (n, bands) and keys.dtype == np.uint64
        for i in range(bands):
            assert partition(keys[:, i]) == partition(sig[:, i * rows:(i + 1) * rows]), (method, i)
    # the 3 columns past bands*rows are not part of any band
    changed = sig.copy()
    changed[:, bands * rows:] = rng.integers(0, 2 ** 32, size=(n, 3), dtype=np.uint32)
    np.testing.assert_array_equal(lsh.band_keys(changed, bands, rows), lsh.band_keys(sig, bands, rows))


def test_exact_method_repairs_a_hash_collision(monkeypatch):
    rng = np.random.default_rng(0)
    sig = rng.integers(0, 3, size=(50, 8), dtype=np.uint32)
    # make every key collide: "exact" must notice and fall back to sorting the rows
    monkeypatch.setattr(lsh, "_hash_bands", lambda s, b, r: np.zeros((s.shape[0], b), np.uint64))
    keys = lsh.band_keys(sig, 4, 2, method="exact")
    for i in range(4):
        assert partition(keys[:, i]) == partition(sig[:, 2 * i:2 * i + 2])
    assert len(partition(lsh.band_keys(sig, 4, 2, method="hash")[:, 0])) == 1  # the broken hash


# --- 5. candidate pairs against datasketch's MinHashLSH ---------------------------------------

def datasketch_candidates(sig: np.ndarray, bands: int, rows: int) -> set[tuple[int, int]]:
    index = datasketch.MinHashLSH(num_perm=sig.shape[1], params=(bands, rows))
    minhashes = [datasketch.MinHash(num_perm=sig.shape[1], hashvalues=row, scheme="affine32")
                 for row in sig]
    for i, m in enumerate(minhashes):
        index.insert(i, m)
    return {(min(i, j), max(i, j)) for i, m in enumerate(minhashes) for j in index.query(m)
            if j != i}


def planted_corpus(rng, n_groups: int = 40, num_perm: int = 128) -> np.ndarray:
    sets = []
    for g in range(n_groups):
        shared = int(rng.integers(0, 30))
        a, b = overlapping_pair(rng, g, 30, shared)
        sets += [a, b, a]                                 # an exact copy, and a near copy
    return datasketch_signatures(sets, num_perm)


@pytest.mark.parametrize("bands,rows", [(16, 8), (20, 5), (32, 4)])
def test_candidate_pairs_equal_datasketch_lsh(bands, rows):
    sig = planted_corpus(np.random.default_rng(bands))
    ours = lsh.candidate_pairs(lsh.band_keys(sig, bands, rows))
    assert ours.dtype == np.int64 and ours.shape[1] == 2
    assert np.all(ours[:, 0] < ours[:, 1])
    assert ours.tolist() == sorted(ours.tolist())          # sorted, unique
    theirs = datasketch_candidates(sig, bands, rows)
    assert len(theirs) > 40                               # not a vacuous comparison
    assert set(map(tuple, ours.tolist())) == theirs


def test_candidate_pairs_equal_datasketch_on_crowded_buckets():
    rng = np.random.default_rng(5)
    sig = rng.integers(0, 3, size=(120, 12), dtype=np.uint32)   # 9 contents per band of 2
    ours = lsh.candidate_pairs(lsh.band_keys(sig, 6, 2))
    theirs = datasketch_candidates(sig, 6, 2)
    assert len(theirs) > 1000
    assert set(map(tuple, ours.tolist())) == theirs


def test_candidate_pairs_guard_and_star_edges_on_one_huge_bucket():
    sig = np.zeros((100, 8), np.uint32)                   # 100 identical documents
    keys = lsh.band_keys(sig, 4, 2)
    assert len(lsh.candidate_pairs(keys)) == 100 * 99 // 2
    with pytest.raises(ValueError, match=r"19800 pairs, counted per band.*max_pairs=100.*100 documents"):
        lsh.candidate_pairs(keys, max_pairs=100)
    edges = lsh.star_edges(keys)
    assert edges.tolist() == [[0, j] for j in range(1, 100)]


def test_star_edges_give_the_components_of_candidate_pairs():
    rng = np.random.default_rng(11)
    sig = rng.integers(0, 4, size=(300, 12), dtype=np.uint32)
    keys = lsh.band_keys(sig, 4, 3)
    pairs, edges = lsh.candidate_pairs(keys), lsh.star_edges(keys)
    assert len(edges) <= 300 * 4 < len(pairs)
    assert set(map(tuple, edges.tolist())) <= set(map(tuple, pairs.tolist()))
    np.testing.assert_array_equal(dedup.clusters(300, edges), dedup.clusters(300, pairs))
    # each edge joins a bucket's member to the bucket's smallest member
    edge_set = set(map(tuple, edges.tolist()))
    for i in range(4):
        for bucket in partition(keys[:, i]):
            smallest = min(bucket)
            for j in bucket - {smallest}:
                assert (smallest, j) in edge_set


def test_no_pairs_from_distinct_documents():
    sig = np.arange(40, dtype=np.uint32).reshape(5, 8)
    keys = lsh.band_keys(sig, 4, 2)
    assert lsh.candidate_pairs(keys).shape == (0, 2)
    assert lsh.star_edges(keys).shape == (0, 2)
    np.testing.assert_array_equal(dedup.clusters(5, lsh.star_edges(keys)), np.arange(5))


# --- 6. the S-curve measured on real MinHash signatures ---------------------------------------

def test_measured_candidate_rate_follows_the_formula():
    bands, rows, size = 20, 5, 30
    rng = np.random.default_rng(0)
    sets, pairs, jacc = [], [], []
    for p in range(1200):
        shared = int(rng.integers(0, size + 1))
        a, b = overlapping_pair(rng, p, size, shared)
        pairs.append((len(sets), len(sets) + 1))
        jacc.append(jaccard(set(a), set(b)))
        sets += [a, b]
    sig = datasketch_signatures(sets, num_perm=bands * rows)
    pairs, jacc = np.array(pairs), np.array(jacc)
    table = lsh.s_curve(sig, pairs, jacc, bands, rows)
    edges = np.linspace(0, 1, 11)
    assert [(row.lo, row.hi) for row in table] == list(zip(edges[:-1], edges[1:]))
    assert sum(row.pairs for row in table) == len(pairs)
    # 4 binomial standard errors per bin (plus 1/n for the p ~ 0 or 1 bins, where se ~ 0)
    for row in table:
        assert row.pairs >= 50
        assert abs(row.measured - row.predicted_mean) <= 4 * row.stderr + 1.0 / row.pairs, row
        assert row.predicted_at_mean == pytest.approx(
            lsh.candidate_probability(jacc[(jacc >= row.lo) & ((jacc < row.hi) | (row.hi == 1))]
                                      .mean(), bands, rows))
    middle = [row for row in table if 0.4 <= row.lo < 0.7]
    assert all(0.1 < row.measured < 0.99 for row in middle)      # the step is where it should be
    # the check has power: the curve with bands and rows swapped is far outside the tolerance
    hit = lsh.banded_match(sig, pairs, bands, rows)
    swapped = lsh.candidate_probability(jacc, rows, bands)
    in_bin = (jacc >= 0.5) & (jacc < 0.6)
    se = np.sqrt(np.sum(swapped[in_bin] * (1 - swapped[in_bin]))) / in_bin.sum()
    assert abs(hit[in_bin].mean() - swapped[in_bin].mean()) > 4 * se + 1.0 / in_bin.sum()


def test_s_curve_empty_bins_and_bad_jaccards():
    sig = np.zeros((2, 4), np.uint32)
    table = lsh.s_curve(sig, np.array([[0, 1]]), np.array([1.0]), 2, 2, bins=np.array([0, .5, 1]))
    assert table[0].pairs == 0 and np.isnan(table[0].measured)
    assert table[1].pairs == 1 and table[1].measured == 1.0 == table[1].predicted_mean
    with pytest.raises(ValueError, match=r"jaccard 1.5 lies outside"):
        lsh.s_curve(sig, np.array([[0, 1]]), np.array([1.5]), 2, 2)
    with pytest.raises(ValueError, match=r"one value per pair: 1 pairs, got shape \(2,\)"):
        lsh.s_curve(sig, np.array([[0, 1]]), np.array([0.5, 0.5]), 2, 2)


# --- 7. verify by exact Jaccard ---------------------------------------------------------------

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


# --- 8. clusters and what is kept -------------------------------------------------------------

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


# --- 9. scores --------------------------------------------------------------------------------

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
