"""The MinHash device kernels, in JAX: shingle hashes from bytes, and minima over permutations.

Two pure functions that run inside the sharded program of `minhash.py`, one device's documents
at a time. `fast_shingle_hashes` turns a byte buffer and its word ranges (`minhash_layout.py`)
into every shingle's fast_hash32 with one prefix sum over the bytes; `min_over_shingles` mixes
each hash with fmix32, applies datasketch's affine32 permutations a * x + b (mod 2^32) and keeps
the running minimum over a document's shingles, so the [documents, shingles, k] product is never
stored. A document without shingles keeps `EMPTY` everywhere, like an empty datasketch MinHash.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale.data.shingles import FAST_P, SHINGLE_WORDS

EMPTY = np.uint32(0xFFFFFFFF)  # the signature value of a permutation that saw no shingle


def _fmix32(h):
    """MurmurHash3's 32-bit finaliser, on uint32 arrays (shingles.fmix32 in JAX)."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def fast_shingle_hashes(data, start, end, n_words, p_pow, p_inv_pow, n: int = SHINGLE_WORDS):
    """Every shingle's fast_hash32, for [docs, words] word ranges into one byte buffer.

    One prefix sum over the bytes gives each word's polynomial hash (shingles.py); a
    shingle's follows from its words', because for bytes x and y
        poly(x + b' ' + y) = poly(x) * P^(len(y) + 1) + (ord(' ') + 1) * P^len(y) + poly(y),
    so the bytes between words (one space, or a run of whitespace) never need copying.
    Returns ([docs, words] uint32 hashes, [docs] number of shingles): column i is the
    shingle that starts at word i.
    """
    terms = (data.astype(jnp.uint32) + 1) * p_inv_pow  # b_j * P^(-j)
    prefix = jax.lax.associative_scan(jnp.add, terms)  # S[j+1]; a scan beats cumsum on CPU
    prefix = jnp.concatenate([jnp.zeros(1, jnp.uint32), prefix])
    word = p_pow[jnp.maximum(end - 1, 0)] * (prefix[end] - prefix[start])  # padding: [0, 0)
    shift = p_pow[end - start]  # P^len(word)
    space = jnp.uint32(ord(" ") + 1)
    cols = jnp.arange(word.shape[1])
    poly = word
    for j in range(1, n):  # append word i+j to the shingle that starts at word i
        nxt, nxt_shift = jnp.roll(word, -j, axis=1), jnp.roll(shift, -j, axis=1)
        grown = (poly * jnp.uint32(FAST_P) + space) * nxt_shift + nxt
        poly = jnp.where(cols + j < n_words[:, None], grown, poly)
    n_shingles = jnp.where(n_words >= n, n_words - n + 1, jnp.minimum(n_words, 1))
    return _fmix32(poly), n_shingles


BLOCK = 8  # shingle columns per loop step (the widths are multiples of it)


def min_over_shingles(hashes, n_shingles, a, b):
    """[docs, shingles] hashes (the first n_shingles of each row valid) -> [docs, k]
    signatures: min over shingles of a * fmix32(h) + b, datasketch's affine32.

    A loop over shingle columns that keeps a [docs, k] running minimum: each step is one
    vectorised multiply-add-min per column, BLOCK columns at a time, and the loop stops at
    the longest document actually present, so padding the width costs nothing here.
    (Written as one min-reduction over a [docs, shingles, k] product, XLA:CPU ran it
    20-40x slower on these shapes.)
    """
    x = _fmix32(hashes)

    def block(i, low):
        cols = jax.lax.dynamic_slice_in_dim(x, i * BLOCK, BLOCK, axis=1)
        for j in range(BLOCK):
            valid = (i * BLOCK + j < n_shingles)[:, None]
            low = jnp.where(valid, jnp.minimum(low, a * cols[:, j, None] + b), low)
        return low

    first = jnp.where((n_shingles > 0)[:, None], a * x[:, 0, None] + b, EMPTY)
    blocks = (jnp.max(n_shingles) + BLOCK - 1) // BLOCK
    return jax.lax.fori_loop(0, blocks, block, first)
