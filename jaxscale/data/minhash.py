"""MinHash signatures in JAX, bit for bit datasketch's, sharded over a mesh's devices.

MinHash turns a set into k numbers whose agreement estimates the Jaccard index. For one
random permutation pi of all possible shingle hashes, P(min pi(A) = min pi(B)) = J(A, B):
the smallest element of A | B under pi is equally likely to be any of them, and the two
minima agree exactly when it lies in A & B. With k independent permutations the fraction of
agreeing minima estimates J with standard deviation sqrt(J (1 - J) / k).

The permutations are datasketch 2.0's default family ("affine32"), so that a signature here
equals `datasketch.MinHash(num_perm=k, seed=seed)` of the same shingles, value for value:
  - each 32-bit shingle hash h (see shingles.py) is first mixed once, x = fmix32(h);
  - permutation i maps x to a_i * x + b_i modulo 2^32, plain uint32 arithmetic whose
    wrap-around is the modulo; a_i odd makes it a bijection of [0, 2^32);
  - a and b come from numpy's RandomState(seed): all k a's (a = 2u + 1, u uniform below
    2^31), then all k b's (uniform below 2^32);
  - signature[i] = min over the document's shingles of a_i * x + b_i; a document without
    shingles keeps 2^32 - 1 everywhere, like an empty datasketch MinHash.

How a corpus is computed (`signatures`):
  1. On the host, a chunk of documents becomes one byte buffer per device, each document
     followed by '\n' (a document holding non-ASCII characters is first normalised with
     ' '.join(text.split()), so that every separator left is an ASCII byte). Word
     boundaries come from numpy on the separators' positions, not from a Python loop over
     words; the device gets each word's byte range as a [documents, words] array.
  2. The shingle hashes. "fast": on the devices, one prefix sum over the buffer's bytes
     gives every word's polynomial hash, and a shingle's hash is composed from its words'
     (`fast_shingle_hashes` shows the identity), so the bytes between words never matter;
     "sha1": hashlib on the host, shingle by shingle (compatible, slow).
  3. On the devices: mix, permute, and take the minimum over each document's shingles,
     a loop over shingle columns that keeps a [documents, k] running minimum, so the
     [documents, shingles, k] product is never stored. The documents of a chunk are split
     over the mesh's devices with shard_map; nothing is communicated.
  Chunks have few shapes (a power of two of documents a device, a fixed byte buffer, words
  padded to a power of two), so a corpus compiles a handful of programs, and while the
  devices work on one chunk the host lays out the next (JAX dispatch is asynchronous).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxscale.data.arrays import positions
from jaxscale.data.shingles import (FAST_P, FAST_P_INV, SHINGLE_HASHES, SHINGLE_WORDS,
                                    sha1_hash32, shingles)

AXIS = "docs"  # the mesh axis documents are split over
EMPTY = np.uint32(0xFFFFFFFF)  # the signature value of a permutation that saw no shingle
DOCS_PER_DEVICE = 1024  # documents a device takes per chunk, at most
BYTES_PER_DEVICE = 1 << 20  # its byte buffer (a longer document gets a buffer of its own)
MAX_NUM_PERM = 1024  # the lecture's largest k; lsh.optimal_params takes no more


class MinHashError(ValueError):
    """Bad MinHash input: the message names the value and the valid choices."""


def check_options(num_perm: int, shingle_hash: str) -> None:
    if isinstance(num_perm, bool) or not isinstance(num_perm, (int, np.integer)) \
            or not 1 <= num_perm <= MAX_NUM_PERM:
        raise MinHashError(f"num_perm must be a whole number from 1 to {MAX_NUM_PERM}, "
                           f"got {num_perm!r}")
    if shingle_hash not in SHINGLE_HASHES:
        raise MinHashError(f"shingle_hash must be one of {', '.join(SHINGLE_HASHES)}, got "
                           f"{shingle_hash!r}")


def permutations(num_perm: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(a, b), each uint32 [num_perm], drawn as datasketch's affine32 scheme draws them."""
    gen = np.random.RandomState(seed)
    a = gen.randint(0, 1 << 31, num_perm, dtype=np.uint32) * np.uint32(2) + np.uint32(1)
    b = gen.randint(0, 1 << 32, num_perm, dtype=np.uint32)
    return a, b


# ------------------------------------------------------------------------------------
# 1. the host: documents -> bytes and word boundaries
# ------------------------------------------------------------------------------------

# The ASCII characters str.split() splits on. Non-ASCII whitespace (U+00A0, U+3000...) is
# multi-byte in UTF-8, so a document holding any non-ASCII character is normalised with
# ' '.join(text.split()) first; after that every separator is an ASCII space, and the
# bytes of a UTF-8 multi-byte character are never below 0x80, so none looks like one.
_SEPARATOR = np.zeros(256, bool)
_SEPARATOR[[9, 10, 11, 12, 13, 28, 29, 30, 31, 32]] = True


@dataclass(frozen=True)
class Words:
    """One device's documents as bytes, with every word's byte range and document."""

    data: np.ndarray  # uint8: the documents, each followed by one '\n'
    start: np.ndarray  # int64 [n_words]: where each word starts in `data`
    end: np.ndarray  # int64 [n_words]: and where it ends (exclusive)
    doc: np.ndarray  # int64 [n_words]: its document, 0 .. n_docs-1
    n_docs: int

    @property
    def counts(self) -> np.ndarray:
        return np.bincount(self.doc, minlength=self.n_docs)


def words(texts: Sequence[str]) -> Words:
    """Word boundaries of every document (a word is a maximal run of non-separator bytes,
    exactly what str.split() returns), from the separators' positions: one comparison
    over the bytes finds the candidates (every separator is below 33), the rest works on
    those ~1/6 as many positions, never on the bytes again."""
    texts = [t if t.isascii() else " ".join(t.split()) for t in texts]
    data = np.frombuffer("\n".join(texts).encode("utf-8") + b"\n", np.uint8)
    lengths = np.fromiter(map(len, texts), np.int64, len(texts))
    if lengths.sum() + len(texts) != len(data):  # some normalised text has multi-byte chars
        lengths = np.fromiter((len(t.encode("utf-8")) for t in texts), np.int64, len(texts))
    sep = np.flatnonzero(data < 33)
    sep = sep[_SEPARATOR[data[sep]]]  # drop control bytes that are not whitespace
    gaps = np.concatenate([[-1], sep])  # a virtual separator before the first byte
    word = np.flatnonzero(np.diff(gaps) > 1)  # a word lies between gaps[i] and gaps[i+1]
    start, end = gaps[word] + 1, gaps[word + 1]
    # the '\n' after each document (a document may hold '\n's of its own) is a separator:
    # flag it, and a word's document is the number of flags up to the gap before it
    flags = np.zeros(len(gaps), np.int64)
    flags[np.searchsorted(gaps, np.cumsum(lengths + 1) - 1)] = 1
    doc = np.cumsum(flags)[word]
    return Words(data, start, end, doc, len(texts))


# ------------------------------------------------------------------------------------
# 2-3. the devices: shingle hashes, permutations, minima
# ------------------------------------------------------------------------------------

def _fmix32(h):
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _powers(base: int, n: int) -> np.ndarray:
    """base^0 .. base^(n-1) modulo 2^32 (numpy's uint32 products wrap)."""
    out = np.full(n, base, np.uint32)
    out[0] = 1
    return np.cumprod(out, dtype=np.uint32)


@functools.lru_cache(maxsize=2)
def _power_tables(mesh: Mesh, n: int) -> tuple[jax.Array, jax.Array]:
    """P^j and P^-j for j < n, on every device of the mesh: made once per buffer length,
    not sent again with every chunk."""
    where = NamedSharding(mesh, P())
    return (jax.device_put(_powers(FAST_P, n), where),
            jax.device_put(_powers(FAST_P_INV, n), where))


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


@functools.lru_cache(maxsize=16)
def _program(mesh: Mesh, fast: bool) -> Callable:
    """One device's work under shard_map: each device has its own buffer and documents."""
    docs = P(AXIS)

    def local(a, b, *inputs):
        if fast:
            data, start, end, n_words, p_pow, p_inv_pow = inputs
            hashes, n_shingles = fast_shingle_hashes(data[0], start[0], end[0], n_words[0],
                                                     p_pow, p_inv_pow)
        else:
            hashes, n_shingles = inputs[0][0], inputs[1][0]
        return min_over_shingles(hashes, n_shingles, a, b)[None]

    in_specs = (P(), P()) + ((docs, docs, docs, docs, P(), P()) if fast else (docs, docs))
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=docs))


def _pow2(n: int, least: int = 64) -> int:
    """The smallest power of two >= n (and >= least): few shapes, so few compilations."""
    return max(least, 1 << (max(n, 1) - 1).bit_length())


def _fast_inputs(parts: list[list[str]], per_dev: int, length: int, mesh: Mesh) -> tuple:
    """Per device: its bytes padded to `length` (or the next power of two that holds
    them), [docs, words] word ranges and word counts."""
    laid = [words(p) for p in parts]
    width = _pow2(max((int(w.counts.max()) for w in laid if w.n_docs), default=1))
    length = max(length, _pow2(max(len(w.data) for w in laid) + 1))
    data = np.zeros((len(parts), length), np.uint8)
    start = np.zeros((len(parts), per_dev, width), np.int32)
    end = np.zeros((len(parts), per_dev, width), np.int32)
    n_words = np.zeros((len(parts), per_dev), np.int32)
    for d, w in enumerate(laid):
        data[d, :len(w.data)] = w.data
        counts = w.counts
        row, col = positions(counts)
        flat = row * width + col
        start[d].reshape(-1)[flat], end[d].reshape(-1)[flat] = w.start, w.end
        n_words[d, :len(counts)] = counts
    return (data, start, end, n_words, *_power_tables(mesh, length))


def _sha1_inputs(parts: list[list[str]], per_dev: int, length: int, mesh: Mesh) -> tuple:
    """Per device: [docs, shingles] sha1_hash32 of the reference shingles, and counts."""
    hashed = [[[sha1_hash32(s) for s in shingles(t)] for t in p] for p in parts]
    width = _pow2(max((len(h) for p in hashed for h in p), default=1))
    hashes = np.zeros((len(parts), per_dev, width), np.uint32)
    counts = np.zeros((len(parts), per_dev), np.int32)
    for d, p in enumerate(hashed):
        c = np.array([len(h) for h in p], np.int64)
        row, col = positions(c)
        hashes[d, row, col] = [v for h in p for v in h]
        counts[d, :len(c)] = c
    return hashes, counts


def signatures(texts: Sequence[str], num_perm: int = 128, seed: int = 1,
               shingle_hash: str = "sha1", *, devices: Sequence[jax.Device] | None = None,
               docs_per_device: int = DOCS_PER_DEVICE,
               bytes_per_device: int = BYTES_PER_DEVICE,
               progress: Callable[[int], None] | None = None) -> np.ndarray:
    """[len(texts), num_perm] uint32 MinHash signatures of the texts' shingle sets.

    Equal, row for row, to datasketch 2.0's `MinHash(num_perm, seed)` updated with
    `shingles.shingles(text)` (and, for shingle_hash="fast", `hashfunc=fast_hash32`).
    `devices` (default: all of JAX's devices) share each chunk's documents; `progress`,
    if given, is called with the number of documents done after each chunk.

    Chunks have few shapes and bounded memory: documents are taken in order of length,
    and a device's share of a chunk is a power of two of them (at most docs_per_device)
    that fits one buffer of bytes_per_device bytes, padded to a power of two of words. So
    a chunk of short documents holds many, a chunk of long ones few, and every document
    length within an octave compiles one program. A document longer than the buffer goes
    alone, in a buffer of the next power of two above its length: memory per device is
    about max(bytes_per_device, the longest document) x 16 (the bytes, their prefix sums
    and power tables, and the [documents, words] ranges).
    """
    check_options(num_perm, shingle_hash)
    devices = list(jax.devices() if devices is None else devices)
    mesh = Mesh(np.array(devices), (AXIS,))
    fast = shingle_hash == "fast"
    program = _program(mesh, fast)
    a, b = (jax.device_put(v, NamedSharding(mesh, P())) for v in permutations(num_perm, seed))
    n_dev = len(devices)
    order = np.argsort(np.fromiter(map(len, texts), np.int64, len(texts)), kind="stable")
    budget = _pow2(bytes_per_device)  # a device's buffer of text, bytes
    out = np.empty((len(texts), num_perm), np.uint32)
    pending, done = None, 0  # (documents, device result): read back one chunk behind

    def collect():
        nonlocal done
        idx, result = pending
        out[idx] = np.asarray(result).reshape(-1, num_perm)[:len(idx)]
        done += len(idx)
        if progress is not None:
            progress(done)

    pos = 0
    while pos < len(texts):
        per_dev = _pow2(docs_per_device, 1)  # halve until the longest document fits
        while per_dev > 1:
            last = order[min(pos + per_dev * n_dev, len(texts)) - 1]
            if per_dev * (len(texts[last]) + 1) <= budget:
                break
            per_dev //= 2
        idx = order[pos:pos + per_dev * n_dev]
        pos += len(idx)
        chunk = [texts[i] for i in idx]
        parts = [chunk[d * per_dev:(d + 1) * per_dev] for d in range(n_dev)]
        inputs = (_fast_inputs if fast else _sha1_inputs)(parts, per_dev, budget, mesh)
        result = program(a, b, *inputs)
        if pending is not None:
            collect()
        pending = (idx, result)
    if pending is not None:
        collect()
    return out


def estimate_jaccard(sig_a: np.ndarray, sig_b: np.ndarray) -> np.ndarray:
    """The fraction of agreeing minima (rows of two [.., k] signature arrays)."""
    return (np.asarray(sig_a) == np.asarray(sig_b)).mean(axis=-1)
