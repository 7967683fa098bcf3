"""The six stages of the cleaning pipeline, one function each, in the order they run.

Each stage function takes the pages still in and returns (which of them to keep or None, its
output, its detail dict): quality filters (`filters.py`) and decontamination (`decontaminate.py`)
judge each page; signatures are MinHash's (`minhash.py`); candidates are LSH's (`lsh.py`), with
identical signatures collapsed first; verification keeps an edge only if the exact Jaccard of its
two pages' shingle sets reaches the threshold; clusters are union-find's (`dedup.py`), the first
page of each kept. `clean.clean` wires them together.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from jaxscale.data import dedup, lsh, minhash
from jaxscale.data.clean_config import CleanConfig
from jaxscale.data.decontaminate import Decontaminator
from jaxscale.data.filters import apply_filters
from jaxscale.data.shingles import shingle_ids

CHUNK = 4096  # pages per call of the per-page stages, so that progress can be shown


def _per_page(texts: Sequence[str], judge: Callable, progress) -> list:
    """judge(a chunk of texts) for each chunk, progress(pages done) after each."""
    out = []
    for start in range(0, len(texts), CHUNK):
        out.append(judge(texts[start:start + CHUNK]))
        progress(min(start + CHUNK, len(texts)))
    return out


def stage_filters(texts: Sequence[str], cfg: CleanConfig, progress=lambda done: None) -> tuple:
    if not cfg.filters:
        return None, None, {"skipped": "no filters"}
    chunks = _per_page(texts, lambda part: apply_filters(part, cfg.filters), progress)
    removed = {name: np.concatenate([c[name] for c in chunks]) if chunks else np.zeros(0, bool)
               for name in cfg.filters}
    hit = np.zeros(len(texts), bool)
    first = {}
    for name, mask in removed.items():  # each page is charged to the first rule it fails
        first[name] = int((mask & ~hit).sum())
        hit |= mask
    return ~hit, None, {"by_filter": first,
                        "failing_each": {n: int(m.sum()) for n, m in removed.items()}}


def stage_decontaminate(texts: Sequence[str], validation: Sequence[str] | None,
                        cfg: CleanConfig, progress=lambda done: None) -> tuple:
    if not cfg.decontaminate:
        return None, None, {"skipped": "turned off"}
    if not validation:
        return None, None, {"skipped": "no validation documents"}
    finder = Decontaminator(validation, cfg.ngram, cfg.min_fraction)
    hit = np.concatenate([np.zeros(0, bool), *_per_page(texts, finder.contaminated, progress)])
    return ~hit, None, {"validation_docs": len(validation), "ngram": cfg.ngram,
                        "min_fraction": cfg.min_fraction}


def stage_signatures(texts: Sequence[str], cfg: CleanConfig, devices=None,
                     progress=None) -> tuple:
    sig = minhash.signatures(texts, cfg.num_perm, cfg.seed, cfg.shingle_hash,
                             devices=devices, progress=progress)
    return None, sig, {"num_perm": cfg.num_perm, "shingle_hash": cfg.shingle_hash}


MAX_PAIRS = 20_000_000  # candidate pairs before falling back to star edges


def stage_candidates(sig: np.ndarray, bands: int, rows: int,
                     max_pairs: int = MAX_PAIRS) -> tuple:
    """Edges to verify: pages with identical signatures linked to the first of them, then
    every LSH candidate pair among the distinct signatures.

    All pairs, not a star per bucket: verification drops an edge whose two pages are not
    similar enough, and a star would lose the link between two copies whose bucket's
    smallest member is a false candidate. Identical signatures (exact copies, whatever
    their number) are collapsed first, so a thousand copies cost 999 edges, not 10^6
    pairs; only if the pairs would still exceed max_pairs are the stars used.
    """
    n = len(sig)
    whole = lsh.band_keys(sig, 1, sig.shape[1])[:, 0]  # one 64-bit key per signature
    _, first, inverse = np.unique(whole, return_index=True, return_inverse=True)
    rep = first[inverse]  # the first page with the same signature
    copies = np.flatnonzero(rep != np.arange(n))
    reps = np.flatnonzero(rep == np.arange(n))
    keys = lsh.band_keys(sig[reps], bands, rows)
    try:
        pairs, kind = reps[lsh.candidate_pairs(keys, max_pairs)], "all pairs"
    except lsh.TooManyPairs:  # enormous buckets: connect them by stars instead
        pairs, kind = reps[lsh.star_edges(keys)], "star edges (too many pairs: see above)"
    edges = np.concatenate([np.stack([rep[copies], copies], 1), pairs.reshape(-1, 2)])
    return None, edges, {"bands": bands, "rows": rows, "edges": len(edges),
                         "identical_signatures": len(copies), "candidate_edges": len(pairs),
                         "edges_kind": kind, "pages_in_an_edge": int(len(np.unique(edges)))}


VERIFY_BLOCK = 1024  # edges verified at once: memory stays bounded however many there are


def stage_verify(texts: Sequence[str], edges: np.ndarray, threshold: float) -> tuple:
    """Exact Jaccard of each edge's two shingle sets >= threshold. The sets are exact
    integer ids (shingles.shingle_ids), made for the pages of VERIFY_BLOCK edges at a time
    (ids need only agree within a pair), so memory does not grow with the edges."""
    ok = np.zeros(len(edges), bool)
    for start in range(0, len(edges), VERIFY_BLOCK):
        block = edges[start:start + VERIFY_BLOCK]
        involved = np.unique(block)
        ids = shingle_ids([texts[i] for i in involved])
        ok[start:start + len(block)] = dedup.verify(np.searchsorted(involved, block), ids,
                                                    threshold)
    return None, ok, {"threshold": threshold, "edges_verified": int(ok.sum()),
                      "edges_rejected": int(len(ok) - ok.sum())}


def stage_clusters(n: int, edges: np.ndarray) -> tuple:
    """Union-find over the verified edges; the first page of each cluster is kept."""
    labels = dedup.clusters(n, edges)  # the smallest page index of each cluster
    sizes = np.bincount(labels, minlength=n)
    sizes = sizes[sizes > 0]
    return dedup.keep_mask(labels), labels, {
        "clusters": int(len(sizes)), "duplicate_clusters": int((sizes > 1).sum()),
        "largest_cluster": int(sizes.max()) if len(sizes) else 0}
