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
     words; the device gets each word's byte range as a [documents, words] array
     (`minhash_layout.py`).
  2. The shingle hashes. "fast": on the devices, one prefix sum over the buffer's bytes
     gives every word's polynomial hash, and a shingle's hash is composed from its words'
     (`minhash_kernels.fast_shingle_hashes` shows the identity), so the bytes between
     words never matter; "sha1": hashlib on the host, shingle by shingle (compatible, slow).
  3. On the devices: mix, permute, and take the minimum over each document's shingles,
     a loop over shingle columns that keeps a [documents, k] running minimum, so the
     [documents, shingles, k] product is never stored (`minhash_kernels.min_over_shingles`).
     The documents of a chunk are split over the mesh's devices with shard_map; nothing is
     communicated.
  Chunks have few shapes (a power of two of documents a device, a fixed byte buffer, words
  padded to a power of two), so a corpus compiles a handful of programs, and while the
  devices work on one chunk the host lays out the next (JAX dispatch is asynchronous).
"""
from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxscale.data.minhash_kernels import fast_shingle_hashes, min_over_shingles
from jaxscale.data.minhash_layout import fast_inputs, pow2, sha1_inputs
from jaxscale.data.shingles import SHINGLE_HASHES

AXIS = "docs"  # the mesh axis documents are split over
DOCS_PER_DEVICE = 1024  # documents a device takes per chunk, at most
BYTES_PER_DEVICE = 1 << 20  # its byte buffer (a longer document gets a buffer of its own)
MAX_NUM_PERM = 1024  # the lecture's largest k; lsh_params.optimal_params takes no more


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
    budget = pow2(bytes_per_device)  # a device's buffer of text, bytes
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
        per_dev = pow2(docs_per_device, 1)  # halve until the longest document fits
        while per_dev > 1:
            last = order[min(pos + per_dev * n_dev, len(texts)) - 1]
            if per_dev * (len(texts[last]) + 1) <= budget:
                break
            per_dev //= 2
        idx = order[pos:pos + per_dev * n_dev]
        pos += len(idx)
        chunk = [texts[i] for i in idx]
        parts = [chunk[d * per_dev:(d + 1) * per_dev] for d in range(n_dev)]
        inputs = (fast_inputs if fast else sha1_inputs)(parts, per_dev, budget, mesh)
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
