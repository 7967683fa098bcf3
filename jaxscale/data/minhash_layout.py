"""The host side of MinHash: a chunk of documents laid out as the devices' input arrays.

A device takes its documents as one byte buffer, each document followed by '\\n', with every
word's byte range as a [documents, words] array (`words` finds the boundaries with numpy on
the separators' positions, never a Python loop over words), and the power tables P^j and P^-j
its prefix-sum hash needs (`fast_inputs`); or, for the slow datasketch-compatible mode, the
shingles' sha1_hash32 computed here (`sha1_inputs`). Everything is padded to powers of two
(`pow2`), so that a corpus compiles a handful of programs.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxscale.data.arrays import positions
from jaxscale.data.shingles import FAST_P, FAST_P_INV, sha1_hash32, shingles

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


def powers(base: int, n: int) -> np.ndarray:
    """base^0 .. base^(n-1) modulo 2^32 (numpy's uint32 products wrap)."""
    out = np.full(n, base, np.uint32)
    out[0] = 1
    return np.cumprod(out, dtype=np.uint32)


@functools.lru_cache(maxsize=2)
def power_tables(mesh: Mesh, n: int) -> tuple[jax.Array, jax.Array]:
    """P^j and P^-j for j < n, on every device of the mesh: made once per buffer length,
    not sent again with every chunk."""
    where = NamedSharding(mesh, P())
    return (jax.device_put(powers(FAST_P, n), where),
            jax.device_put(powers(FAST_P_INV, n), where))


def pow2(n: int, least: int = 64) -> int:
    """The smallest power of two >= n (and >= least): few shapes, so few compilations."""
    return max(least, 1 << (max(n, 1) - 1).bit_length())


def fast_inputs(parts: list[list[str]], per_dev: int, length: int, mesh: Mesh) -> tuple:
    """Per device: its bytes padded to `length` (or the next power of two that holds
    them), [docs, words] word ranges and word counts."""
    laid = [words(p) for p in parts]
    width = pow2(max((int(w.counts.max()) for w in laid if w.n_docs), default=1))
    length = max(length, pow2(max(len(w.data) for w in laid) + 1))
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
    return (data, start, end, n_words, *power_tables(mesh, length))


def sha1_inputs(parts: list[list[str]], per_dev: int, length: int, mesh: Mesh) -> tuple:
    """Per device: [docs, shingles] sha1_hash32 of the reference shingles, and counts."""
    hashed = [[[sha1_hash32(s) for s in shingles(t)] for t in p] for p in parts]
    width = pow2(max((len(h) for p in hashed for h in p), default=1))
    hashes = np.zeros((len(parts), per_dev, width), np.uint32)
    counts = np.zeros((len(parts), per_dev), np.int32)
    for d, p in enumerate(hashed):
        c = np.array([len(h) for h in p], np.int64)
        row, col = positions(c)
        hashes[d, row, col] = [v for h in p for v in h]
        counts[d, :len(c)] = c
    return hashes, counts
