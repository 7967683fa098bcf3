"""Locality-sensitive hashing of MinHash signatures ("banding"): which pairs to compare.

Where this sits. Each document is a set of shingles (`shingles.py`); `minhash.py` turns it into a
signature of k = num_perm 32-bit values, one per hash function, and for any one function
P(two documents' values agree) = their Jaccard s. Comparing all N(N-1)/2 pairs of signatures is
out of the question at N = 10^6, so we hash the signatures into buckets instead, such that similar
documents tend to share a bucket and dissimilar ones rarely do.

The banding trick. Cut the k values into b bands of r consecutive rows (columns [i*r, (i+1)*r) of
the signature make band i; any columns past b*r are left unused, as datasketch does). Two
documents become *candidates* when all r values of at least one band agree. For one band,
P(all r agree) = s^r; bands use disjoint hash functions, so they are independent and

    P(candidate | Jaccard s) = 1 - (1 - s^r)^b.

As a function of s this is an S-curve: near 0 for small s, near 1 for large s, and steepest near
the threshold t ~ (1/b)^(1/r) (where one band's chance s^r reaches 1/b). The lecture's example,
b = 20, r = 5 (k = 100): t ~ 0.55, and P = 0.047 at s = 0.3, 0.470 at s = 0.5, 0.975 at s = 0.7
(`tests/test_data_lsh.py` computes these from the formula).

Choosing (b, r). Pairs below the threshold that become candidates are false positives, pairs above
it that do not are false negatives. Their "areas" under the curve,

    FP(t) = integral_0^t  1 - (1 - s^r)^b  ds,      FN(t) = integral_t^1  (1 - s^r)^b  ds,

are what datasketch minimises (weighted, over all b*r <= k) to pick (b, r) for a threshold:
`optimal_params` reproduces its choice. Both integrands are polynomials in s of degree b*r, so
Gauss-Legendre quadrature with n >= (b*r + 1)/2 nodes integrates them exactly (up to rounding);
no scipy needed.

From signatures to candidates, one stage after another:
  1. `band_keys`      one 64-bit key per (document, band): equal keys <=> equal bands.
  2. `candidate_pairs` every pair i < j sharing a key in some band (a bucket of m documents gives
                      m(m-1)/2 pairs, so it is guarded), or
     `star_edges`     each bucket's members linked to its smallest member: the same connected
                      components from at most N*b edges (what datatrove does).
and to measure: `s_curve` (the measured candidate rate per Jaccard bin beside the formula).
What happens to the candidates next (exact verification, union-find clusters, one document
kept per cluster, pair precision and recall) is `dedup.py`.

Everything here is a pure function on numpy arrays; none of it needs JAX.
"""
from __future__ import annotations

import functools

from typing import NamedTuple, Sequence

import numpy as np

from jaxscale.data.arrays import as_pairs, positive_int, rank_rows

__all__ = [
    "candidate_probability", "threshold_estimate", "false_positive_area", "false_negative_area",
    "optimal_params", "check_params", "band_keys", "candidate_pairs", "star_edges",
    "SCurveRow", "banded_match", "s_curve",
]


# ---------------------------------------------------------------------------------------------
# 1. The S-curve and the threshold.

def candidate_probability(s, bands: int, rows: int) -> np.ndarray | float:
    """P(two documents of Jaccard s become candidates) = 1 - (1 - s^r)^b.

    Computed as -expm1(b * log1p(-s^r)), which keeps its accuracy where the answer is tiny
    (small s, where 1 - (1 - x)^b would cancel). `s` may be a scalar or an array in [0, 1].
    """
    s_arr = np.asarray(s, dtype=np.float64)
    with np.errstate(divide="ignore"):  # s = 1 gives log1p(-1) = -inf, and -expm1(-inf) = 1
        p = -np.expm1(bands * np.log1p(-(s_arr ** rows)))
    return float(p) if p.ndim == 0 else p


def threshold_estimate(bands: int, rows: int) -> float:
    """(1/b)^(1/r): the Jaccard where one band's chance s^r equals 1/b, near the curve's step."""
    return (1.0 / bands) ** (1.0 / rows)


# ---------------------------------------------------------------------------------------------
# 2. The false positive / false negative areas, exactly, and datasketch's choice of (b, r).

def _gauss_legendre_area(lo: float, hi: float, bands: np.ndarray, rows: np.ndarray,
                         negative: bool, degree: int | None = None) -> np.ndarray:
    """integral_lo^hi of P(s) (or of 1 - P(s) if `negative`) for arrays of (b, r), exactly.

    The integrand is a polynomial of degree b*r; n Gauss-Legendre nodes are exact for degree
    2n - 1, so n = degree // 2 + 1 nodes (degree: at least max(b*r)) are exact for every
    pair at once.
    """
    bands = np.asarray(bands, dtype=np.float64)
    rows = np.asarray(rows, dtype=np.float64)
    degree = int(np.max(bands * rows)) if degree is None else degree
    x, w = _leggauss(degree // 2 + 1)                       # nodes and weights on [-1, 1]
    s = 0.5 * (hi - lo) * x + 0.5 * (hi + lo)                # mapped onto [lo, hi]
    w = 0.5 * (hi - lo) * w
    miss = (1.0 - s[:, None] ** rows.ravel()[None, :]) ** bands.ravel()[None, :]  # (1-s^r)^b
    integrand = miss if negative else 1.0 - miss
    return (w @ integrand).reshape(bands.shape)


@functools.lru_cache(maxsize=4)
def _leggauss(n: int) -> tuple[np.ndarray, np.ndarray]:
    """n Gauss-Legendre nodes and weights (numpy's eigenvalue method: 0.25 s at n = 513,
    3.4 s at 1025, so num_perm is capped at MAX_NUM_PERM)."""
    return np.polynomial.legendre.leggauss(n)


def _check_threshold(threshold: float) -> float:
    if not (isinstance(threshold, (int, float, np.floating, np.integer))
            and 0.0 < float(threshold) < 1.0):
        raise ValueError(f"threshold must be a number in (0, 1), got {threshold!r}")
    return float(threshold)


def false_positive_area(threshold: float, bands, rows) -> np.ndarray | float:
    """integral_0^t 1 - (1 - s^r)^b ds: how much of the curve lies below the threshold.

    `bands` and `rows` may be arrays (broadcast together), giving one area per pair.
    """
    t = _check_threshold(threshold)
    b, r = np.broadcast_arrays(np.asarray(bands), np.asarray(rows))
    area = _gauss_legendre_area(0.0, t, b, r, negative=False)
    return float(area) if area.ndim == 0 else area


def false_negative_area(threshold: float, bands, rows) -> np.ndarray | float:
    """integral_t^1 (1 - s^r)^b ds: how much of the curve is missing above the threshold."""
    t = _check_threshold(threshold)
    b, r = np.broadcast_arrays(np.asarray(bands), np.asarray(rows))
    area = _gauss_legendre_area(t, 1.0, b, r, negative=True)
    return float(area) if area.ndim == 0 else area


def _check_weights(weights: Sequence[float]) -> tuple[float, float]:
    w = tuple(float(x) for x in weights)
    if len(w) != 2 or any(not (0.0 <= x <= 1.0) for x in w) or abs(sum(w) - 1.0) > 1e-12:
        raise ValueError(f"weights must be two numbers in [0, 1] summing to 1 "
                         f"(false positive, false negative), got {tuple(weights)!r}")
    return w


MAX_NUM_PERM = 1024  # the most permutations optimal_params takes (its quadrature's cost)


def optimal_params(threshold: float, num_perm: int,
                   weights: Sequence[float] = (0.5, 0.5)) -> tuple[int, int]:
    """The (bands, rows), b*r <= num_perm, minimising w_fp * FP(t) + w_fn * FN(t).

    Same search as datasketch's `MinHashLSH(threshold=...)`: every b in 1..k with every
    r in 1..floor(k/b), in that order, the first strict minimum winning ties. datasketch
    integrates with scipy's adaptive quadrature (error ~1e-10); we integrate exactly, so on a
    near-tie the two could in principle differ; the test checks they agree on a grid.
    """
    t = _check_threshold(threshold)
    k = positive_int("num_perm", num_perm)
    if k > MAX_NUM_PERM:
        raise ValueError(f"num_perm must be at most {MAX_NUM_PERM} to choose bands and rows "
                         f"from a threshold, got {k}; give bands and rows instead")
    w_fp, w_fn = _check_weights(weights)
    best, best_error = (0, 0), np.inf
    for b in range(1, k + 1):  # one band count at a time: memory O(nodes x k/b)
        r = np.arange(1, k // b + 1)
        bb = np.full(len(r), b)
        error = (w_fp * _gauss_legendre_area(0.0, t, bb, r, negative=False, degree=k)
                 + w_fn * _gauss_legendre_area(t, 1.0, bb, r, negative=True, degree=k))
        i = int(np.argmin(error))  # the first minimum, like datasketch's loop
        if error[i] < best_error:
            best, best_error = (b, int(r[i])), float(error[i])
    return best


def check_params(num_perm: int, bands: int | None = None, rows: int | None = None,
                 threshold: float | None = None,
                 weights: Sequence[float] = (0.5, 0.5)) -> tuple[int, int]:
    """Validate a banding choice and return (bands, rows).

    Give exactly one of: both `bands` and `rows`, or a `threshold` in (0, 1) (then
    `optimal_params(threshold, num_perm, weights)` chooses). We require bands * rows <= num_perm,
    like datasketch, not equality: the columns past b*r are simply unused. (datasketch's index
    also refuses b < 2; a single band is allowed here, it is just an exact-match on r values.)
    """
    k = positive_int("num_perm", num_perm)
    given_pair = bands is not None or rows is not None
    if given_pair and threshold is not None:
        raise ValueError(f"give either (bands, rows) or threshold, not both: got bands={bands!r}, "
                         f"rows={rows!r}, threshold={threshold!r}")
    if threshold is not None:
        return optimal_params(threshold, k, weights)
    if bands is None or rows is None:
        raise ValueError(f"give both bands and rows (or a threshold instead): got bands={bands!r}, "
                         f"rows={rows!r}")
    b = positive_int("bands", bands)
    r = positive_int("rows", rows)
    if b * r > k:
        fits = [bb for bb in range(1, k + 1) if bb * r <= k]
        raise ValueError(f"bands * rows = {b} * {r} = {b * r} exceeds num_perm = {k}: with rows={r} "
                         f"bands can be at most {max(fits) if fits else 0}; with bands={b} "
                         f"rows can be at most {k // b}")
    return b, r


# ---------------------------------------------------------------------------------------------
# 3. One key per (document, band).

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


def _as_signatures(signatures: np.ndarray) -> np.ndarray:
    sig = np.asarray(signatures)
    if sig.ndim != 2:
        raise ValueError(f"signatures must be a 2-D array [documents, num_perm], got shape "
                         f"{sig.shape}")
    if sig.dtype == np.uint32:
        return sig
    if not np.issubdtype(sig.dtype, np.integer):
        raise ValueError(f"signatures must hold integers (uint32), got dtype {sig.dtype}")
    if sig.size and (sig.min() < 0 or sig.max() > 0xFFFFFFFF):
        raise ValueError(f"signature values must fit in uint32, got range "
                         f"[{sig.min()}, {sig.max()}]")
    return sig.astype(np.uint32)


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
    sig = _as_signatures(signatures)
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
# 4. Buckets -> pairs, or buckets -> star edges.

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


# ---------------------------------------------------------------------------------------------
# 7. Measuring: precision / recall of pairs, and the S-curve measured against the formula.

class SCurveRow(NamedTuple):
    """One Jaccard bin of `s_curve`: the measured candidate rate beside the formula's."""
    lo: float
    hi: float
    pairs: int
    measured: float           # fraction of the bin's pairs that agree on all rows of some band
    predicted_at_mean: float  # 1 - (1 - s^r)^b at the bin's mean Jaccard
    predicted_mean: float     # mean over the bin's pairs of 1 - (1 - s^r)^b (what `measured`
    #                           estimates: each pair is an independent Bernoulli trial)
    stderr: float             # sqrt(sum p_i (1 - p_i)) / pairs: the standard error of `measured`


def banded_match(signatures: np.ndarray, pairs: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """For each pair: do the two signatures agree on all r rows of at least one band?"""
    sig = _as_signatures(signatures)
    b, r = check_params(sig.shape[1], bands, rows)
    p = as_pairs(pairs, sig.shape[0])
    same = sig[p[:, 0], :b * r] == sig[p[:, 1], :b * r]
    return same.reshape(len(p), b, r).all(axis=2).any(axis=1)


def s_curve(signatures: np.ndarray, pairs: np.ndarray, jaccards: np.ndarray, bands: int,
            rows: int, bins: np.ndarray | None = None) -> list[SCurveRow]:
    """The S-curve measured: for pairs of known exact Jaccard, per Jaccard bin, the fraction
    that banding makes candidates, beside 1 - (1 - s^r)^b.

    Bins are [lo, hi) except the last, [lo, hi]; an empty bin's rates are nan. With s_i the
    bin's Jaccards, `measured` is a mean of independent Bernoulli(p_i = P(s_i)) trials, so it
    should lie within a few `stderr` of `predicted_mean`.
    """
    edges = np.linspace(0.0, 1.0, 11) if bins is None else np.asarray(bins, dtype=np.float64)
    if edges.ndim != 1 or edges.size < 2 or np.any(np.diff(edges) <= 0):
        raise ValueError(f"bins must be increasing bin edges, got {edges!r}")
    s = np.asarray(jaccards, dtype=np.float64)
    p = as_pairs(pairs)
    if s.shape != (len(p),):
        raise ValueError(f"jaccards must have one value per pair: {len(p)} pairs, got shape "
                         f"{s.shape}")
    outside = (s < edges[0]) | (s > edges[-1])
    if outside.any():
        raise ValueError(f"jaccard {s[outside][0]} lies outside the bins "
                         f"[{edges[0]}, {edges[-1]}]")
    hit = banded_match(signatures, p, bands, rows)
    prob = candidate_probability(s, bands, rows)
    which = np.clip(np.searchsorted(edges, s, side="right") - 1, 0, edges.size - 2)
    rows_out = []
    for k in range(edges.size - 1):
        m = which == k
        c = int(m.sum())
        if c:
            pk = prob[m]
            row = SCurveRow(float(edges[k]), float(edges[k + 1]), c, float(hit[m].mean()),
                            float(candidate_probability(s[m].mean(), bands, rows)),
                            float(pk.mean()), float(np.sqrt(np.sum(pk * (1 - pk))) / c))
        else:
            row = SCurveRow(float(edges[k]), float(edges[k + 1]), 0, *([float("nan")] * 4))
        rows_out.append(row)
    return rows_out
