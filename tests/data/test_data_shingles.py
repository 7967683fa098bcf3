"""Shingles as defined in jaxscale.data.shingles, and their exact integer ids."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from jaxscale.data import dedup
from jaxscale.data.shingles import (FAST_P, FAST_P_INV, fast_hash32, fmix32, jaccard,
                                    shingle_ids, shingle_set, shingles)


def test_the_definition_on_hand_examples():
    assert shingles("") == [] and shingles(" \n\t ") == []
    assert shingles("a  b\tc") == [b"a b c"]  # under 5 words: one shingle of all of them
    assert shingles("a b c d e f") == [b"a b c d e", b"b c d e f"]
    assert shingles("x x x x x x") == [b"x x x x x"] * 2  # repeats kept; the set has one
    assert shingle_set("x x x x x x") == {b"x x x x x"}
    assert jaccard(frozenset(), frozenset()) == 1.0


def test_fast_hash_is_the_documented_polynomial():
    assert FAST_P % 2 == 1 and (FAST_P * FAST_P_INV) % 2**32 == 1
    data = "ça va".encode()
    poly = sum((b + 1) * pow(FAST_P, len(data) - 1 - j, 2**32) for j, b in enumerate(data))
    assert fast_hash32(data) == fmix32(poly % 2**32)
    assert fast_hash32(b"") == fmix32(0) and fast_hash32(b"a") != fast_hash32(b"a ")


words = st.sampled_from(["a", "b", "c", "ça", "日本", "x1"])
texts = st.lists(st.lists(words, max_size=12).map(" ".join), min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(texts)
def test_ids_give_the_same_sets_as_the_strings(docs):
    ids = shingle_ids(docs)
    sets = [shingle_set(t) for t in docs]
    assert [len(i) for i in ids] == [len(s) for s in sets]
    assert all(np.all(np.diff(i) > 0) for i in ids)  # sorted, unique
    pairs = np.array([(i, j) for i in range(len(docs)) for j in range(i + 1, len(docs))],
                     np.int64).reshape(-1, 2)
    if len(pairs):
        ours = dedup.jaccards(pairs, ids)
        ref = [jaccard(sets[i], sets[j]) for i, j in pairs.tolist()]
        np.testing.assert_array_equal(ours, ref)


def test_ids_stay_exact_when_the_vocabulary_is_too_big_to_pack():
    """7,000 distinct words: 7001^5 > 2^63, so rows are ranked instead of packed."""
    big = " ".join(f"u{i}" for i in range(7000))
    docs = [big, big[: len(big) // 2], "u1 u2 u3 u4 u5", "u2 u3 u4 u5 u6 u7"]
    ids = shingle_ids(docs)
    sets = [shingle_set(t) for t in docs]
    assert [len(i) for i in ids] == [len(s) for s in sets]
    for i in range(4):
        for j in range(4):
            inter = len(np.intersect1d(ids[i], ids[j]))
            assert inter == len(sets[i] & sets[j])
