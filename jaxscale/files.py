"""Files written whole: a reader, or the next run, sees the old file or the new one, never
half of one; and a command's output folder holds one run's files, never one run's beside
another's.

Every file jaxscale writes whole for later reading goes through `replacing` (the
exceptions are logs that grow a line at a time, like metrics.jsonl, whose reader drops a
half-written last line, and Orbax's own checkpoint files): the bytes go to a
temporary name in the same folder (the same file system, so the rename is atomic), and only
a write that finished is renamed over the target. A failure, or Ctrl-C, leaves the target
as it was and removes the temporary file. `durable=True` also waits for the disk before the
rename and for the folder after it, for the files a restarted process must trust after a
crash (the record of fired faults, a cleaned data set); a cache that can be rebuilt does
without.

A run that writes result.json, a chart and a log into a folder where an earlier run wrote
the same names, and is interrupted half way, would leave the new log beside the old chart:
a mix no reader can tell apart. So before its first write a run removes what an earlier run
left of its own set of names (`start_output_set`: nothing else in the folder is touched, a
user's files, a checkpoint folder inside it), and writes each file whole. The folder then
holds either this run's files (complete, or marked partial by the run) or, when the run
stopped before writing anything, none of the set.
"""
from __future__ import annotations

import os
import secrets
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO


@contextmanager
def replacing(path: Path, mode: str = "w", durable: bool = False) -> Iterator[IO]:
    """A file opened for writing (`mode` "w" or "wb") that replaces `path` when the block
    ends without an exception, and never otherwise. A symbolic link is followed (its
    target is replaced, as `open` would write it); the new file has the process's default
    permissions, not the old file's."""
    path = Path(path)
    if path.is_symlink():
        path = path.resolve()
    # its own name even for two writers of one path on two hosts sharing the folder
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with open(tmp, mode, encoding=None if "b" in mode else "utf-8") as f:
            yield f
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if durable:  # the rename itself survives a power loss once its folder is synced
            folder = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(folder)
            finally:
                os.close(folder)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomically(path: Path, text: str, durable: bool = False) -> None:
    """Write `text` to `path` whole or not at all (`replacing`)."""
    with replacing(path, durable=durable) as f:
        f.write(text)


def write_lines_atomically(path: Path, lines: Iterable[str], durable: bool = False) -> None:
    """Write each of `lines` followed by a newline, whole or not at all; `lines` may be a
    generator, so a large file is never held in memory."""
    with replacing(path, durable=durable) as f:
        for line in lines:
            f.write(line)
            f.write("\n")


def start_output_set(out: Path, names: Iterable[str]) -> Path:
    """Create `out` (with its parents) and remove the files `names` an earlier run left."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        (out / name).unlink(missing_ok=True)
    return out
