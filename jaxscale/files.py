"""A command's output folder holds one run's files, never one run's beside another's.

A run that writes result.json, a chart and a log into a folder where an earlier run wrote
the same names, and is interrupted half way, would leave the new log beside the old chart:
a mix no reader can tell apart. So before its first write a run removes what an earlier run
left of its own set of names (nothing else in the folder is touched: a user's files, a
checkpoint folder inside it), and each file is written whole (`write_text_atomically`).
The folder then holds either this run's files (complete, or marked partial by the run) or,
when the run stopped before writing anything, none of the set.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def start_output_set(out: Path, names: Iterable[str]) -> Path:
    """Create `out` (with its parents) and remove the files `names` an earlier run left."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        (out / name).unlink(missing_ok=True)
    return out


def write_text_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename: a reader sees the old
    file or the new one, never half of one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
