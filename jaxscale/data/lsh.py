"""Locality-sensitive hashing of MinHash signatures ("banding"): which pairs to compare.

Where this sits. Each document is a set of shingles (`shingles.py`); `minhash.py` turns it into a
signature of k = num_perm 32-bit values, one per hash function, and for any one function
P(two documents' values agree) = their Jaccard s. Comparing all N(N-1)/2 pairs of signatures is
out of the question at N = 10^6, so we hash the signatures into buckets instead, such that similar
documents tend to share a bucket and dissimilar ones rarely do: cut the k values into b bands of
r rows, and two documents become *candidates* when all r values of some band agree, with
probability 1 - (1 - s^r)^b. That S-curve and the choice of (b, r) are `lsh_params.py`; the curve
measured on real signatures is `lsh_scurve.py`.

From signatures to candidates, one stage after another:
  1. `band_keys`      one 64-bit key per (document, band): equal keys <=> equal bands.
  2. `candidate_pairs` every pair i < j sharing a key in some band (a bucket of m documents gives
                      m(m-1)/2 pairs, so it is guarded), or
     `star_edges`     each bucket's members linked to its smallest member: the same connected
                      components from at most N*b edges (what datatrove does).
What happens to the candidates next (exact verification, union-find clusters, one document
kept per cluster, pair precision and recall) is `dedup.py`.

Everything here is a pure function on numpy arrays; none of it needs JAX.
"""
from __future__ import annotations

import numpy as np

from jaxscale.data.arrays import as_signatures, rank_rows
from jaxscale.data.lsh_params import check_params


# ---------------------------------------------------------------------------------------------
# 1. One key per (document, band).

_FMIX_C1 = np.uint64(0xFF51AFD7ED558CCD)
_FMIX_C2 = np.uint64(0xC4CEB9FE1A85EC53)
_SEED = np.uint64(0x9E3779B97F4A7C15)  # 64-bit golden ratio: any odd constant would do


def _fmix64(h: np.ndarray, tmp: np.ndarray) -> None:
    """MurmurHash3's 64-bit finaliser, a bijection of uint64, in place (`tmp`: scratch, same
    shape): h ^= h >> 33; h *= C1; h ^= h >> 33; h *= C2; h ^= h >> 33."""
    shift = np.uint64(33)
    for c in (_FMIX_C1, _FMIX_C2, None):
        np.right_shift(h, shift, out=tmp)
        h ^= tmp
        if c is not None:
            h *= c


def _hash_bands(sig: np.ndarray, b: int, r: int, chunk: int = 1 << 15) -> np.ndarray:
    """[N, b] uint64: fmix64-fold of each band's 64-bit words (see `band_keys`).

    Done `chunk` documents at a time with in-place operations, so the working set stays in
    cache (about 4x faster at N = 10^6 than whole-array temporaries).
    """
    n = sig.shape[0]
    out = np.empty((n, b), dtype=np.uint64)
    start = _SEED + np.arange(b, dtype=np.uint64)            # a different start in every band
    for lo in range(0, n, chunk):
        cube = sig[lo:lo + chunk, :b * r].reshape(-1, b, r)
        h = out[lo:lo + chunk]
        h[:] = start
        tmp = np.empty_like(h)
        if r >= 2:                                           # (rows, b, r // 2): hi << 32 | lo
            words = np.ascontiguousarray(cube[:, :, :r - r % 2]).view("<u8")
        for j in range(r // 2):
            h ^= words[:, :, j]
            _fmix64(h, tmp)
        if r % 2:
            h ^= cube[:, :, r - 1]
            _fmix64(h, tmp)
    return out


def band_keys(signatures: np.ndarray, bands: int, rows: int,
              method: str = "hash") -> np.ndarray:
    """[N, k] uint32 signatures -> [N, bands] uint64 keys: key[:, i] names band i's r values.

    Keys are only ever compared within one band's column. Two methods:
      - "hash" (default): the band's r values read two at a time as 64-bit words
        w = col[2j+1] << 32 | col[2j] (an odd r leaves one last 32-bit word), folded
        h <- fmix64(h ^ w) from a per-band start. fmix64 (MurmurHash3's finaliser) is a
        bijection, so r <= 2 is exact, and two bands that differ only in their last word never
        collide. Otherwise count a collision as a 2^-64 event: with N documents the expected
        number of colliding distinct pairs is <= b * N^2 / 2^65, about 4e-7 for N = 10^6, b = 16.
        A collision adds one false candidate, which `verify` removes (with `star_edges` and no
        `verify` it could merge two clusters, at that rate).
      - "exact": the hash keys, then checked: sort each band by key and compare neighbouring
        rows. If no two neighbours with equal keys differ, equal keys <=> equal bands (within a
        run of one key all rows are then equal, by transitivity), so the keys stand; a band where
        a collision shows up is renumbered by a lexicographic sort of its rows (slow but sure).
        Costs about one extra sort per band.
    """
    sig = as_signatures(signatures)
    b, r = check_params(sig.shape[1], bands, rows)
    if method not in ("hash", "exact"):
        raise ValueError(f"method must be 'hash' or 'exact', got {method!r}")
    keys = _hash_bands(sig, b, r)
    if method == "exact":
        for i in range(b):
            order = np.argsort(keys[:, i])
            same_key = keys[order[1:], i] == keys[order[:-1], i]
            if not same_key.any():
                continue
            x, y = order[1:][same_key], order[:-1][same_key]
            band = sig[:, i * r:(i + 1) * r]
            if np.any(band[x] != band[y]):
                keys[:, i] = rank_rows(band).astype(np.uint64)
    return keys


# ---------------------------------------------------------------------------------------------
# 2. Buckets -> pairs, or buckets -> star edges.

def _as_keys(keys: np.ndarray) -> np.ndarray:
    k = np.asarray(keys)
    if k.ndim != 2:
        raise ValueError(f"keys must be a 2-D array [documents, bands], got shape {k.shape}")
    return k


def _holders(column: np.ndarray, shared: np.ndarray) -> np.ndarray:
    """Indices i, ascending, with column[i] in the sorted array `shared`.

    A coarse filter first, a bit table indexed by the low bits of the key (small enough to stay
    in cache, so one gather per document), then an exact searchsorted on what passes.
    """
    bits = int(min(24, max(10, np.ceil(np.log2(16 * shared.size)))))
    mask = np.uint64((1 << bits) - 1)
    table = np.zeros(1 << bits, dtype=bool)
    table[shared & mask] = True
    maybe = np.flatnonzero(table[column & mask])
    at = np.minimum(np.searchsorted(shared, column[maybe]), shared.size - 1)
    return maybe[shared[at] == column[maybe]]


def _buckets(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The buckets of every band with two or more members, laid end to end.

    Most documents are alone in most bands, so the singletons are dropped first, cheaply: sort
    a band's keys (a plain sort, much faster than argsort), take the values that repeat, and
    find their documents (`_holders`); only those are argsorted (stably, so each bucket
    lists its documents in index order). Returns, per position p of the concatenation,
    (member[p], run_start[p], run_size[p], run_min[p]): the document, the first position of its
    bucket, the bucket's size and its smallest member.
    """
    n, b = keys.shape
    columns = np.ascontiguousarray(keys.T)                    # [b, N]: each band contiguous
    members, new_run = [], []
    for column in columns:
        ordered = np.sort(column)
        repeats = ordered[1:][ordered[1:] == ordered[:-1]]
        if repeats.size == 0:
            continue
        shared = np.unique(repeats)                           # keys held by >= 2 documents
        docs = _holders(column, shared)
        docs = docs[np.argsort(column[docs], kind="stable")]  # by key, then by index
        grouped = column[docs]
        starts = np.ones(docs.size, dtype=bool)
        starts[1:] = grouped[1:] != grouped[:-1]
        members.append(docs)
        new_run.append(starts)
    if not members:
        empty = np.empty(0, np.int64)
        return empty, empty, empty, empty
    member = np.concatenate(members).astype(np.int64)
    first = np.flatnonzero(np.concatenate(new_run))
    sizes = np.diff(np.append(first, member.size))
    return (member, np.repeat(first, sizes), np.repeat(sizes, sizes),
            np.repeat(member[first], sizes))                  # stable sort: first is smallest


def _unique_pairs(a: np.ndarray, b: np.ndarray, n: int) -> np.ndarray:
    """Unique unordered pairs as a sorted [P, 2] int64 array with column 0 < column 1."""
    lo = np.minimum(a, b).astype(np.int64)
    hi = np.maximum(a, b).astype(np.int64)
    code = np.unique(lo * n + hi)
    return np.stack([code // n, code % n], axis=1) if code.size else np.empty((0, 2), np.int64)


class TooManyPairs(ValueError):
    """candidate_pairs would build more pairs than max_pairs (the message says how many)."""


def candidate_pairs(keys: np.ndarray, max_pairs: int = 50_000_000) -> np.ndarray:
    """All unique pairs i < j that share a key in at least one band, sorted, as [P, 2] int64.

    A bucket of m documents yields m(m-1)/2 pairs, so one big bucket (say, 10^4 copies of a
    boilerplate page) is 5 * 10^7 pairs. Before generating anything the total over all buckets
    is counted (per band, so a pair sharing several bands counts several times); above
    `max_pairs` we raise, naming the biggest bucket: use `star_edges` for
    clustering instead, which needs only m - 1 edges per bucket.
    """
    keys = _as_keys(keys)
    n = keys.shape[0]
    member, run_start, run_size, _ = _buckets(keys)
    offset = np.arange(member.size) - run_start              # position within the bucket
    later = run_size - 1 - offset                            # partners after this position
    total = int(later.sum())
    if total > max_pairs:
        raise TooManyPairs(f"candidate_pairs would generate {total} pairs, counted per band before "
                         f"removing repeats (> max_pairs={max_pairs}); "
                         f"the largest bucket has {int(run_size.max())} documents: use "
                         f"star_edges for clustering, or raise max_pairs")
    # each position p pairs with p+1, ..., p+later[p]: repeat p, add a count restarting at each p
    source = np.repeat(np.arange(member.size), later)
    restart = np.repeat(np.cumsum(later) - later, later)
    partner = source + 1 + (np.arange(total) - restart)
    return _unique_pairs(member[source], member[partner], n)


def star_edges(keys: np.ndarray) -> np.ndarray:
    """Each bucket's members linked to its smallest member: [E, 2] int64, unique, sorted.

    A bucket of m documents gives m - 1 edges instead of m(m-1)/2 pairs, and the same connected
    components, so E <= N * bands whatever the buckets look like.
    """
    keys = _as_keys(keys)
    n, _ = keys.shape
    member, _, _, run_min = _buckets(keys)
    linked = member != run_min
    return _unique_pairs(run_min[linked], member[linked], n)
