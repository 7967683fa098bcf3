"""MinHash signatures against datasketch 2.0 (the reference), bit for bit, in both shingle
hash modes, on one device and on the session's eight, in chunks of any size."""
from __future__ import annotations

import datasketch
import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jaxscale.data import minhash as mh
from jaxscale.data.minhash_kernels import EMPTY, fast_shingle_hashes
from jaxscale.data.minhash_layout import fast_inputs
from jaxscale.data.shingles import fast_hash32, sha1_hash32, shingle_set, shingles, jaccard

HASHFUNC = {"sha1": sha1_hash32, "fast": fast_hash32}


def _texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    vocab = [f"w{i}" for i in range(300)] + ["garden", "ça", "日本語", "x"]
    texts = [" ".join(rng.choice(vocab, size=int(rng.integers(0, 40)))) for _ in range(n)]
    # what str.split() treats specially: runs of whitespace, tabs, newlines, ASCII
    # separators \x1c-\x1f, non-ASCII spaces (U+00A0, U+3000), and documents of 0-4 words
    return texts + ["", "   ", "one", "a b c d", "a  b\tc\nd\x1ce", "α\u00a0β\u3000γ δ ε ζ",
                    " lead and trail  ", "a b c d e", "x\r\ny\x0bz\x0cw\x1fv u"]


def _reference(texts, num_perm: int, seed: int, mode: str) -> np.ndarray:
    rows = []
    for t in texts:
        m = datasketch.MinHash(num_perm=num_perm, seed=seed, hashfunc=HASHFUNC[mode])
        m.update_batch(shingles(t))
        rows.append(m.hashvalues)
    return np.array(rows)


def test_permutations_are_datasketchs():
    for k, seed in [(1, 1), (128, 1), (100, 7), (256, 12345)]:
        a, b = mh.permutations(k, seed)
        ref = datasketch.MinHash(num_perm=k, seed=seed).permutations
        assert a.dtype == b.dtype == np.uint32
        np.testing.assert_array_equal(a, ref[0])
        np.testing.assert_array_equal(b, ref[1])
        assert np.all(a % 2 == 1)


def test_datasketchs_default_hash_is_sha1_hash32():
    for data in [b"", b"a", b"the green tomato grows .", "日本".encode()]:
        assert sha1_hash32(data) == datasketch.hashfunc.sha1_hash32(data)


@pytest.mark.parametrize("mode", ["sha1", "fast"])
def test_signatures_equal_datasketch_bit_for_bit(mode):
    texts = _texts(150)
    ours = mh.signatures(texts, num_perm=64, seed=3, shingle_hash=mode, docs_per_device=8)
    ref = _reference(texts, 64, 3, mode)
    assert ours.dtype == np.uint32 and ours.shape == (len(texts), 64)
    assert np.abs(ours.astype(np.int64) - ref.astype(np.int64)).max() == 0
    assert np.all(ours[texts.index("")] == EMPTY)  # no shingles: datasketch's empty sketch


@pytest.mark.slow
def test_one_device_eight_devices_and_chunk_sizes_agree():
    texts = _texts(90, seed=1)
    eight = mh.signatures(texts, 32, shingle_hash="fast", docs_per_device=4)
    assert len(jax.devices()) == 8
    one = mh.signatures(texts, 32, shingle_hash="fast", devices=jax.devices()[:1],
                        docs_per_device=128)
    two = mh.signatures(texts, 32, shingle_hash="fast", devices=jax.devices()[:2],
                        docs_per_device=1)
    np.testing.assert_array_equal(eight, one)
    np.testing.assert_array_equal(eight, two)


def test_long_documents_shrink_the_chunk_and_stay_exact():
    rng = np.random.default_rng(2)
    long = " ".join(f"t{i}" for i in rng.integers(0, 50, 3000))  # ~15 KB
    texts = _texts(20, seed=2) + [long, long[:7000]]
    done = []
    ours = mh.signatures(texts, 16, shingle_hash="fast", docs_per_device=4,
                         progress=done.append)
    np.testing.assert_array_equal(ours, _reference(texts, 16, 1, "fast"))
    assert done[-1] == len(texts) and done == sorted(done)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.text(alphabet=st.sampled_from("ab \t\n\u00a0é日"), max_size=30),
                min_size=1, max_size=6))
def test_vector_shingle_hashes_equal_the_reference_on_any_text(texts):
    """The device's fast hashes (prefix sums over raw bytes) equal fast_hash32 of the
    reference shingles: whitespace runs, non-ASCII and short documents included."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), (mh.AXIS,))
    inputs = fast_inputs([texts], len(texts), 64, mesh)
    data, start, end, n_words, p_pow, p_inv_pow = inputs
    hashes, n_sh = jax.jit(fast_shingle_hashes)(data[0], start[0], end[0], n_words[0],
                                               p_pow, p_inv_pow)
    hashes, n_sh = np.asarray(hashes), np.asarray(n_sh)
    for i, t in enumerate(texts):
        ref = [fast_hash32(s) for s in shingles(t)]
        assert n_sh[i] == len(ref)
        assert hashes[i, :len(ref)].tolist() == ref


def test_the_estimate_agrees_with_the_true_jaccard_within_its_spread():
    rng = np.random.default_rng(4)
    words = [f"v{i}" for i in rng.integers(0, 10**6, 400)]
    a = " ".join(words[:300])
    b = " ".join(words[100:])  # 200 of 296 shingles shared
    true = jaccard(shingle_set(a), shingle_set(b))
    k = 512
    sig = mh.signatures([a, b], k, seed=9, shingle_hash="fast")
    est = float(mh.estimate_jaccard(sig[0], sig[1]))
    assert abs(est - true) < 4 * np.sqrt(true * (1 - true) / k)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_perm=0), "num_perm must be a whole number from 1 to 1024, got 0"),
    (dict(num_perm=2.5), "got 2.5"),
    (dict(shingle_hash="md5"), "shingle_hash must be one of fast, sha1, got 'md5'"),
])
def test_bad_options_are_named(kwargs, match):
    with pytest.raises(mh.MinHashError, match=match):
        mh.signatures(["a b c"], **kwargs)
