"""Scoring a cleaning run against the garden web corpus's ground truth.

Each removing stage is scored on the pages that reached it:
  - filters: should remove the junk pages;
  - decontamination: should remove the pages holding a validation document;
  - clusters (deduplication): of each group of true near-duplicates (pages joined by
    pairs whose exact shingle Jaccard reaches the run's verification threshold, see
    `WebCorpus.duplicate_pairs`), all but one should go. A removal is right when the
    removed page lies in such a group and the group lost no more than size - 1 pages.
precision = right removals / removals, recall = right removals / removals that should
have happened.
"""
from __future__ import annotations

import numpy as np

from jaxscale.data import dedup
from jaxscale.data.web import KINDS


def _score(removed: int, right: int, should: int) -> dict:
    return {"removed": removed, "right": right, "should": should,
            "precision": right / removed if removed else 1.0,
            "recall": right / should if should else 1.0}


def score_report(report, web) -> dict:
    """Precision and recall of each removing stage (see the module docstring)."""
    names = [s.name for s in report.stages]
    by = report.removed_by
    kind = np.asarray(web.kind)
    out = {}
    reached = np.ones(len(by), bool)
    for name, truth in (("filters", kind == KINDS.index("junk")),
                        ("decontamination", kind == KINDS.index("contaminated"))):
        idx = names.index(name)
        gone = by == idx
        if "skipped" not in report.stages[idx].detail:  # a stage that did not run: no score
            out[name] = _score(int(gone.sum()), int((gone & truth).sum()),
                               int((reached & truth).sum()))
        reached &= ~gone
    out["clusters"] = _dedup_score(reached, by == names.index("clusters"),
                                   web.duplicate_pairs(report.config.verify_threshold()))
    return {"stages": out, "truth": "garden web corpus labels (jaxscale.data.web)"}


def _dedup_score(reached: np.ndarray, gone: np.ndarray, pairs: np.ndarray) -> dict:
    pairs = np.asarray(pairs, np.int64).reshape(-1, 2)
    pairs = pairs[reached[pairs[:, 0]] & reached[pairs[:, 1]]]
    labels = dedup.clusters(len(reached), pairs)
    size = np.bincount(labels, minlength=len(reached))
    in_group = size[labels] > 1
    lost = np.bincount(labels[gone & in_group], minlength=len(reached))
    right = int(np.minimum(lost, np.maximum(size - 1, 0)).sum())
    should = int(np.maximum(size[size > 1] - 1, 0).sum())
    return _score(int(gone.sum()), right, should)
