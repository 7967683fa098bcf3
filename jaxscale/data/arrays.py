"""Array idioms and input checks the data pipeline needs in several places, written once."""
from __future__ import annotations

import numpy as np


def rank_rows(rows: np.ndarray) -> np.ndarray:
    """int64 [N]: a dense rank of each row of [N, m], equal exactly for equal rows (a
    lexicographic sort, by column 0, then 1, ...)."""
    order = np.lexsort(rows.T[::-1])
    ordered = rows[order]
    new = np.ones(len(rows), bool)
    new[1:] = np.any(ordered[1:] != ordered[:-1], axis=1)
    rank = np.empty(len(rows), np.int64)
    rank[order] = np.cumsum(new) - 1
    return rank


def positions(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For items stored group after group, counts[g] of them in group g: each item's group
    and its position within the group (np.repeat and a restarting arange)."""
    counts = np.asarray(counts, np.int64)
    group = np.repeat(np.arange(len(counts)), counts)
    starts = np.cumsum(counts) - counts
    return group, np.arange(len(group)) - starts[group]


def positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def as_pairs(pairs: np.ndarray, n: int | None = None, name: str = "pairs") -> np.ndarray:
    p = np.asarray(pairs)
    if p.size == 0:
        return np.empty((0, 2), np.int64)
    if p.ndim != 2 or p.shape[1] != 2 or not np.issubdtype(p.dtype, np.integer):
        raise ValueError(f"{name} must be an integer array of shape [P, 2], got shape {p.shape} "
                         f"dtype {p.dtype}")
    upper = np.iinfo(np.int64).max if n is None else n
    bad = (p < 0) | (p >= upper)
    if bad.any():
        valid = "non-negative" if n is None else f"0..{n - 1}"
        raise ValueError(f"{name} holds document index {int(p[bad][0])}, valid indices are {valid}")
    return p.astype(np.int64, copy=False)


def as_signatures(signatures: np.ndarray) -> np.ndarray:
    """[documents, num_perm] MinHash signatures as uint32, or a ValueError naming what is wrong."""
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
