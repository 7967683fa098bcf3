"""What `jaxscale data clean` shows and writes: progress, the table of stages, the --out files.

The --out folder is checked before any work, when parsed (cli.paths.output_dir);
`StageProgress` draws a bar on stderr for each stage that goes through the pages (a line for
the others); `write_out` writes kept.jsonl, removed.jsonl and report.json together, so that
a folder holds one complete run or none; and `print_report` prints the stages as a table,
with each removing stage's precision and recall when the input was the labelled garden web
corpus. (--json prints the report's JSON object instead, in `data.py`.)
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from jaxscale.data.clean_report import stage_note
from jaxscale.files import write_lines_atomically, write_text_atomically
from jaxscale.report import Progress, print_table


class StageProgress:
    """A progress bar for each stage that goes through the pages; a line for the others."""

    PER_PAGE = ("filters", "decontamination", "signatures")

    def __init__(self, enabled: bool):
        self.enabled, self.stage, self.bar = enabled, None, None

    def __call__(self, stage: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        if stage != self.stage:
            self.close()
            self.stage = stage
            if stage in self.PER_PAGE and total:
                self.bar = Progress(total, label=stage)
            else:
                print(f"{stage}: {total:,} pages", file=sys.stderr, flush=True)
        if self.bar is not None and done:
            self.bar.update(done, f"{done:,} pages")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


OUTPUTS = ("kept.jsonl", "removed.jsonl", "report.json")


def write_out(out: Path, report, ids, lines, texts, result) -> None:
    """kept.jsonl, removed.jsonl and report.json, written together: into a temporary
    folder inside `out`, then renamed into place, report.json last (so a folder whose
    report.json is there and newer than the others holds one complete run)."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".tmp-{os.getpid()}"
    tmp.mkdir(exist_ok=True)
    try:
        kept = report.kept.tolist()
        if lines is None:  # the garden corpus: write id and text
            lines = [json.dumps({"id": i, "text": t}, ensure_ascii=False)
                     for i, t in zip(ids, texts)]
        write_lines_atomically(tmp / "kept.jsonl", (lines[i] for i in kept), durable=True)
        names = [s.name for s in report.stages]

        def removed(i: int) -> str:
            line = {"id": ids[i], "stage": names[report.removed_by[i]]}
            if report.duplicate_of[i] >= 0:
                line["duplicate_of"] = ids[report.duplicate_of[i]]
            return json.dumps(line, ensure_ascii=False)
        write_lines_atomically(tmp / "removed.jsonl",
                               map(removed, (report.removed_by >= 0).nonzero()[0].tolist()),
                               durable=True)
        write_text_atomically(tmp / "report.json", json.dumps(result, indent=1) + "\n",
                              durable=True)
        (out / "report.json").unlink(missing_ok=True)  # no report.json while the set changes
        for name in OUTPUTS:
            os.replace(tmp / name, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def print_report(r: dict) -> None:
    """The stages as a table under a title line of the run's totals."""
    scores = r.get("scores", {}).get("stages", {})
    rows = []
    for s in r["stages"]:
        sc = scores.get(s["name"])
        rows.append([s["name"], f"{s['docs_in']:,}", f"{s['removed']:,}", f"{s['kept']:,}",
                     f"{s['seconds']:.2f}",
                     "-" if sc is None else f"{sc['precision']:.3f}",
                     "-" if sc is None else f"{sc['recall']:.3f}", stage_note(s["name"], s)])
    print_table(f"{r['input']}: kept {r['kept']:,} of {r['docs']:,} "
                f"({r['docs_per_s']:,.0f} docs/s end to end; b={r['bands']} bands x "
                f"r={r['rows']} rows, verify at Jaccard >= {r['verify_threshold']:.3f})",
                ["stage", "in", "removed", "kept", "seconds", "precision", "recall", "notes"],
                rows)
    if "out" in r:
        print(f"wrote {r['out']}/kept.jsonl, removed.jsonl, report.json")
