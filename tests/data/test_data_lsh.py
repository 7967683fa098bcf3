"""LSH banding (`jaxscale.data.lsh`) and the S-curve measured (`jaxscale.data.lsh_scurve`),
checked against datasketch 2.0 and plain Python references. Pure numpy: no JAX compilation,
the whole file runs in a few seconds."""
from __future__ import annotations

import numpy as np
import pytest

from jaxscale.data import dedup, lsh, lsh_scurve
from jaxscale.data.lsh_params import candidate_probability
from jaxscale.data.shingles import jaccard

datasketch = pytest.importorskip("datasketch")


# --- helpers: references written the slow, obvious way ---------------------------------------

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


# --- 1. bad input -----------------------------------------------------------------------------

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


# --- 2. band keys -----------------------------------------------------------------------------

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


# --- 3. candidate pairs against datasketch's MinHashLSH ---------------------------------------

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


# --- 4. the S-curve measured on real MinHash signatures ---------------------------------------

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
    table = lsh_scurve.s_curve(sig, pairs, jacc, bands, rows)
    edges = np.linspace(0, 1, 11)
    assert [(row.lo, row.hi) for row in table] == list(zip(edges[:-1], edges[1:]))
    assert sum(row.pairs for row in table) == len(pairs)
    # 4 binomial standard errors per bin (plus 1/n for the p ~ 0 or 1 bins, where se ~ 0)
    for row in table:
        assert row.pairs >= 50
        assert abs(row.measured - row.predicted_mean) <= 4 * row.stderr + 1.0 / row.pairs, row
        assert row.predicted_at_mean == pytest.approx(
            candidate_probability(jacc[(jacc >= row.lo) & ((jacc < row.hi) | (row.hi == 1))]
                                      .mean(), bands, rows))
    middle = [row for row in table if 0.4 <= row.lo < 0.7]
    assert all(0.1 < row.measured < 0.99 for row in middle)      # the step is where it should be
    # the check has power: the curve with bands and rows swapped is far outside the tolerance
    hit = lsh_scurve.banded_match(sig, pairs, bands, rows)
    swapped = candidate_probability(jacc, rows, bands)
    in_bin = (jacc >= 0.5) & (jacc < 0.6)
    se = np.sqrt(np.sum(swapped[in_bin] * (1 - swapped[in_bin]))) / in_bin.sum()
    assert abs(hit[in_bin].mean() - swapped[in_bin].mean()) > 4 * se + 1.0 / in_bin.sum()


def test_s_curve_empty_bins_and_bad_jaccards():
    sig = np.zeros((2, 4), np.uint32)
    table = lsh_scurve.s_curve(sig, np.array([[0, 1]]), np.array([1.0]), 2, 2, bins=np.array([0, .5, 1]))
    assert table[0].pairs == 0 and np.isnan(table[0].measured)
    assert table[1].pairs == 1 and table[1].measured == 1.0 == table[1].predicted_mean
    with pytest.raises(ValueError, match=r"jaccard 1.5 lies outside"):
        lsh_scurve.s_curve(sig, np.array([[0, 1]]), np.array([1.5]), 2, 2)
    with pytest.raises(ValueError, match=r"one value per pair: 1 pairs, got shape \(2,\)"):
        lsh_scurve.s_curve(sig, np.array([[0, 1]]), np.array([0.5, 0.5]), 2, 2)
