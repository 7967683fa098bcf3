"""The cleaning pipeline, wired: `clean` runs the six stages, each on what the one before kept.

    1. filters          cheap heuristics (filters.py): junk pages go first, before any hashing
    2. decontamination  pages sharing a 13-gram with the validation set (decontaminate.py)
    3. signatures       MinHash of each surviving page's 5-word shingles (minhash.py)
    4. candidates       LSH: pages agreeing on every row of some band (lsh.py), as pairs;
                        pages with identical signatures are collapsed first
    5. verification     each candidate edge kept only if the exact Jaccard of the two
                        shingle sets reaches the threshold
    6. clusters         union-find over the verified edges; the first page of each cluster
                        (in input order) is kept

Each stage function (`clean_stages.py`) takes the pages still in and returns (which of them
to keep, its output, its counts); `_Run` times it and records a `Stage`, and `Report`
(`clean_report.py`) collects them, with the end-to-end documents per second. The settings
are one `CleanConfig` (`clean_config.py`). With the bands and rows given instead of a
threshold, the verification threshold is the S-curve's own, (1/b)^(1/r): where a pair's
chance of becoming a candidate is 1 - (1 - 1/b)^b, about 1 - 1/e = 0.63.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np

from jaxscale.data.clean_config import CleanConfig
from jaxscale.data.clean_report import Report, Stage
from jaxscale.data.clean_stages import (stage_candidates, stage_clusters, stage_decontaminate,
                                        stage_filters, stage_signatures, stage_verify)


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
