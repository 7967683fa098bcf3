"""The cleaning pipeline: one config, one function per numbered stage, the wiring in `clean`.

    1. filters          cheap heuristics (filters.py): junk pages go first, before any hashing
    2. decontamination  pages sharing a 13-gram with the validation set (decontaminate.py)
    3. signatures       MinHash of each surviving page's 5-word shingles (minhash.py)
    4. candidates       LSH: pages agreeing on every row of some band (lsh.py), as pairs;
                        pages with identical signatures are collapsed first
    5. verification     each candidate edge kept only if the exact Jaccard of the two
                        shingle sets reaches the threshold
    6. clusters         union-find over the verified edges; the first page of each cluster
                        (in input order) is kept

Each stage function takes the pages still in and returns (which of them to keep, its
output, its counts); `_Run` times it and records a `Stage`, and `Report` collects them,
with the end-to-end documents per second. With the bands and rows given instead of a
threshold, the verification threshold is the S-curve's own, (1/b)^(1/r): where a pair's
chance of becoming a candidate is 1 - (1 - 1/b)^b, about 1 - 1/e = 0.63.
"""
from __future__ import annotations

import functools
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import numpy as np

from jaxscale.data import dedup, lsh, minhash
from jaxscale.data.decontaminate import MIN_FRACTION, N_GRAM, Decontaminator
from jaxscale.data.filters import FILTERS, apply_filters
from jaxscale.data.shingles import shingle_ids


class CleanError(ValueError):
    """A bad pipeline setting: the message names the value and the valid choices."""


DEFAULT_THRESHOLD = 0.7


@dataclass(frozen=True)
class CleanConfig:
    num_perm: int = 128
    seed: int = 1  # of the MinHash permutations (datasketch's meaning)
    threshold: float | None = None  # Jaccard of near-duplicates (DEFAULT_THRESHOLD if
    bands: int | None = None  #        neither it nor bands and rows are given)
    rows: int | None = None
    shingle_hash: str = "fast"
    filters: tuple[str, ...] = tuple(FILTERS)
    decontaminate: bool = True
    ngram: int = N_GRAM  # decontamination: words per n-gram
    min_fraction: float = MIN_FRACTION  # and the share of one document's n-grams

    @functools.cached_property
    def _params(self) -> tuple[int, int]:
        given = self.bands is not None or self.rows is not None
        threshold = DEFAULT_THRESHOLD if self.threshold is None and not given else self.threshold
        return lsh.check_params(self.num_perm, self.bands, self.rows, threshold)

    def lsh_params(self) -> tuple[int, int]:
        """(bands, rows): as given, or chosen for the threshold as datasketch chooses."""
        return self._params

    def verify_threshold(self) -> float:
        """The threshold, or with bands and rows given the curve's own, (1/b)^(1/r)."""
        if self.threshold is not None or (self.bands is None and self.rows is None):
            return DEFAULT_THRESHOLD if self.threshold is None else self.threshold
        return lsh.threshold_estimate(*self.lsh_params())

    def check(self) -> "CleanConfig":
        minhash.check_options(self.num_perm, self.shingle_hash)
        unknown = [f for f in self.filters if f not in FILTERS]
        if unknown:
            raise CleanError(f"unknown filter {unknown[0]!r}; choose from {', '.join(FILTERS)}")
        try:
            self.lsh_params()
            Decontaminator(["a"], self.ngram, self.min_fraction)  # checks n and the fraction
        except ValueError as e:
            raise CleanError(str(e)) from None
        return self


@dataclass
class Stage:
    name: str
    docs_in: int
    removed: int
    seconds: float
    detail: dict = field(default_factory=dict)

    @property
    def kept(self) -> int:
        return self.docs_in - self.removed


def stage_note(name: str, d: dict) -> str:
    """One line on what a stage did beyond its counts, from its detail."""
    if "skipped" in d:
        return f"skipped: {d['skipped']}"
    if name == "filters":
        return ", ".join(f"{k} {v:,}" for k, v in d["by_filter"].items() if v) or "-"
    if name == "decontamination":
        return (f"{d['validation_docs']:,} validation docs, {d['min_fraction']:g} of one's "
                f"{d['ngram']}-grams")
    if name == "signatures":
        return f"k = {d['num_perm']}, {d['shingle_hash']} shingle hash"
    if name == "candidates":
        return (f"b = {d['bands']} x r = {d['rows']}: {d['edges']:,} edges "
                f"({d['identical_signatures']:,} of identical signatures), {d['edges_kind']}")
    if name == "verification":
        return (f"J >= {d['threshold']:.3g}: {d['edges_verified']:,} of "
                f"{d['edges_verified'] + d['edges_rejected']:,} edges kept")
    return f"{d['duplicate_clusters']:,} clusters of copies, largest {d['largest_cluster']:,}"


@dataclass
class Report:
    docs: int
    stages: list[Stage]
    kept: np.ndarray  # indices of the kept documents, ascending
    removed_by: np.ndarray  # int8 per document: index into stages of what removed it, or -1
    duplicate_of: np.ndarray  # int64 per document: the kept page of its cluster, or -1
    bands: int
    rows: int
    seconds: float
    config: CleanConfig

    @property
    def docs_per_s(self) -> float:
        return self.docs / self.seconds if self.seconds > 0 else float("inf")

    def as_json(self) -> dict:
        return {"docs": self.docs, "kept": len(self.kept), "removed": self.docs - len(self.kept),
                "bands": self.bands, "rows": self.rows,
                "verify_threshold": self.config.verify_threshold(),
                "seconds": self.seconds, "docs_per_s": self.docs_per_s,
                "config": asdict(self.config),
                "stages": [{"name": s.name, "docs_in": s.docs_in, "removed": s.removed,
                            "kept": s.kept, "seconds": s.seconds, **s.detail}
                           for s in self.stages]}


# ---- the stages: each returns (keep mask over its pages or None, output, detail) -------

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


# ---- the wiring ------------------------------------------------------------------------

class _Run:
    """The bookkeeping of one run: which pages are still in, and what each stage did."""

    def __init__(self, texts: Sequence[str], note: Callable[[str, int, int], None]):
        self.texts, self.note = texts, note
        self.alive = np.arange(len(texts))  # the pages still in, as indices into texts
        self.removed_by = np.full(len(texts), -1, np.int8)
        self.stages: list[Stage] = []
        self.pages = list(texts)  # the texts of self.alive

    def stage(self, name: str, work: Callable[[list[str]], tuple]):
        """Run work(pages still in) -> (keep or None, output, detail); return the output."""
        pages = self.pages
        self.note(name, 0, len(pages))
        t0 = time.perf_counter()
        keep, output, detail = work(pages)
        removed = 0 if keep is None else int(len(pages) - keep.sum())
        self.stages.append(Stage(name, len(pages), removed, time.perf_counter() - t0, detail))
        if keep is not None and not keep.all():
            self.removed_by[self.alive[~keep]] = len(self.stages) - 1
            self.alive = self.alive[keep]
            self.pages = [self.texts[i] for i in self.alive]
        return output


def clean(texts: Sequence[str], cfg: CleanConfig = CleanConfig(), *,
          validation: Sequence[str] | None = None, devices=None,
          progress: Callable[[str, int, int], None] | None = None) -> Report:
    """Run the stages on `texts`; the Report says what each removed and which survived.

    `progress(stage, done, total)` is called as each stage starts, and as the per-page
    stages (filters, decontamination, signatures) go through their pages."""
    cfg.check()
    bands, rows = cfg.lsh_params()
    threshold = cfg.verify_threshold()
    note = progress or (lambda *a: None)
    t0 = time.perf_counter()
    run = _Run(texts, note)
    def counter(name: str, pages: list):  # progress of a stage over its pages
        return lambda done: note(name, done, len(pages))

    run.stage("filters", lambda pages: stage_filters(pages, cfg, counter("filters", pages)))
    run.stage("decontamination", lambda pages: stage_decontaminate(
        pages, validation, cfg, counter("decontamination", pages)))
    sig = run.stage("signatures", lambda pages: stage_signatures(
        pages, cfg, devices, counter("signatures", pages)))
    edges = run.stage("candidates", lambda pages: stage_candidates(sig, bands, rows))
    ok = run.stage("verification", lambda pages: stage_verify(pages, edges, threshold))
    before = run.alive
    labels = run.stage("clusters", lambda pages: stage_clusters(len(pages), edges[ok]))
    duplicate_of = np.full(len(texts), -1, np.int64)  # a removed duplicate -> the kept one
    gone = labels != np.arange(len(labels))
    duplicate_of[before[gone]] = before[labels[gone]]
    return Report(len(texts), run.stages, run.alive, run.removed_by, duplicate_of, bands,
                  rows, time.perf_counter() - t0, cfg)
