"""Shingles: what a document is, as a set, for near-duplicate detection.

The definition, exactly, so anyone can check it:
  - words = text.split()   (Python's split: any run of whitespace separates words)
  - each shingle is ' '.join of SHINGLE_WORDS (5) consecutive words, encoded UTF-8;
    a document of 1 to 4 words is one shingle of all its words; an empty document has none.
  - a document is the *set* of its shingles; two documents' similarity is the Jaccard index
    |A & B| / |A | B| of their sets.

Each shingle is then hashed to 32 bits, by one of two functions (`SHINGLE_HASHES`):
  - "sha1": the first 4 bytes of SHA-1, little-endian (datasketch's default `sha1_hash32`,
    re-implemented here so the library needs no datasketch). Compatible, but computed byte
    string by byte string in Python.
  - "fast": `fast_hash32`, a polynomial hash of the bytes modulo 2^32 finished with
    MurmurHash3's fmix32. It is defined on bytes, so datasketch can be given it as `hashfunc`
    and must then agree with us bit for bit; and it has a form that a vector machine computes
    for every shingle of a corpus at once (see `minhash_kernels.fast_shingle_hashes`): with
    b_j = byte_j + 1 and an odd multiplier P,
        poly(bytes[s:e]) = sum_j b_j * P^(e-1-j)  (mod 2^32)
                         = P^(e-1) * (S[e] - S[s]),   S[i] = sum_{j<i} b_j * P^(-j),
    where P^(-1) exists modulo 2^32 because P is odd. One prefix sum over a corpus's bytes
    gives every word's hash with two lookups and a multiply, whatever its length, and a
    shingle's hash follows from its words' (poly(x + b' ' + y) = (poly(x) * P + 33) *
    P^len(y) + poly(y)).
"""
from __future__ import annotations

import hashlib
import itertools
import struct

import numpy as np

from jaxscale.data.arrays import positions, rank_rows

SHINGLE_WORDS = 5
SHINGLE_HASHES = ("fast", "sha1")

FAST_P = 0x9E3779B1  # odd (the 32-bit golden-ratio constant): invertible modulo 2^32
FAST_P_INV = pow(FAST_P, -1, 1 << 32)
_M32 = 0xFFFFFFFF


def word_ngrams(words: list[str], n: int) -> list[str]:
    """The runs of n consecutive words, space-joined, in order; all the words as one when
    there are fewer than n; none when there are none. (Shingles here, and the n-grams
    decontamination looks for.)"""
    if len(words) < n:
        return [" ".join(words)] if words else []
    return [" ".join(words[i:i + n]) for i in range(len(words) - n + 1)]


def shingles(text: str, n: int = SHINGLE_WORDS) -> list[bytes]:
    """The document's shingles in order (repeats kept), by the definition above."""
    return [g.encode("utf-8") for g in word_ngrams(text.split(), n)]


def shingle_set(text: str, n: int = SHINGLE_WORDS) -> frozenset[bytes]:
    return frozenset(shingles(text, n))


def jaccard(a: frozenset | set, b: frozenset | set) -> float:
    """|A & B| / |A | B|; two empty sets are identical (1.0)."""
    union = len(a | b)
    return len(a & b) / union if union else 1.0


def sha1_hash32(data: bytes) -> int:
    """The first 4 bytes of SHA-1, little-endian: datasketch's default hash, bit for bit."""
    return struct.unpack("<I", hashlib.sha1(data).digest()[:4])[0]


def fmix32(h: int) -> int:
    """MurmurHash3's 32-bit finalizer (a bijection that spreads every input bit)."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def fast_hash32(data: bytes) -> int:
    """fmix32 of sum_j (byte_j + 1) * P^(n-1-j) mod 2^32: the reference of the vector form."""
    h = 0
    for byte in data:
        h = (h * FAST_P + byte + 1) & _M32
    return fmix32(h)


def _row_codes(rows: np.ndarray, base: int) -> np.ndarray:
    """An int64 per row, equal exactly for equal rows of small non-negative ints < base:
    the row read as a number in base `base` when that fits 63 bits, else its rank."""
    if base ** rows.shape[1] < 2 ** 63:
        code = np.zeros(len(rows), np.int64)
        for col in rows.T:
            code = code * base + col
        return code
    return rank_rows(rows)


def shingle_ids(texts) -> list[np.ndarray]:
    """Each text's shingle set as sorted unique int64 ids, exact and shared across `texts`:
    two texts hold the same id exactly when they hold the same shingle (no hashing).

    The same sets as `shingle_set`, computed without building a string per shingle: every
    word gets an id (one dict lookup, in C), a shingle is the row of its SHINGLE_WORDS word
    ids (ids count from 1; 0 pads a short document's row), and a row is one exact integer
    (the ids as digits, or the row's rank when they do not fit 63 bits).
    """
    split = [t.split() for t in texts]
    counts = np.fromiter(map(len, split), np.int64, len(split))
    flat = list(itertools.chain.from_iterable(split))
    vocab = {w: i for i, w in enumerate(dict.fromkeys(flat))}
    ids = np.fromiter(map(vocab.__getitem__, flat), np.int64, len(flat))
    start = np.concatenate([[0], np.cumsum(counts)[:-1]])
    n = SHINGLE_WORDS
    per_doc = np.where(counts >= n, counts - n + 1, np.minimum(counts, 1))  # shingles
    owner, nth = positions(per_doc)
    first = start[owner] + nth  # the shingle's first word
    pos = first[:, None] + np.arange(n)  # the shingle's word positions
    inside = pos < (start + counts)[owner][:, None]  # short documents end early
    rows = np.where(inside, ids[np.minimum(pos, max(len(ids) - 1, 0))] + 1, 0) \
        if len(ids) else np.zeros((0, n), np.int64)
    code = _row_codes(rows, len(vocab) + 1)
    order = np.lexsort((code, owner))
    owner, code = owner[order], code[order]
    keep = np.ones(len(code), bool)
    keep[1:] = (owner[1:] != owner[:-1]) | (code[1:] != code[:-1])
    owner, code = owner[keep], code[keep]
    bounds = np.searchsorted(owner, np.arange(len(texts) + 1))
    return [code[bounds[i]:bounds[i + 1]] for i in range(len(texts))]
