"""What a cleaning run reports: one `Stage` record per stage, and the run's `Report`.

A `Stage` counts the pages that reached a stage and those it removed, with its time and a
`detail` dict of what else it did; `stage_note` turns that detail into one line for a table.
The `Report` holds the stages, which pages were kept, which stage removed each of the others
(and, for a duplicate, the kept page it duplicates), and `as_json`, the figures as the
`jaxscale data clean --json` object prints them.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from jaxscale.data.clean_config import CleanConfig


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
