"""Output paths checked before any work: argparse types for `--out DIR` and `--png FILE`.

A run that computes for a minute and then fails to write its result has lost the minute.
Both types check only what can be known up front, without creating anything:
  - a folder (`output_dir`) may not exist yet (it is created, with its parents, when the
    result is written), but it must not be an existing file, and the nearest folder above
    it that does exist must be writable;
  - a file (`output_file`) must not be an existing folder, and its parent folder must
    already exist and be writable (a file option never creates folders).
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path


def _nearest_existing(path: Path) -> Path:
    for parent in (path, *path.parents):
        if parent.exists():
            return parent
    return Path(".")


def output_dir(text: str) -> Path:
    """argparse type: a folder that exists or can be created (it is not created here)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the output folder must not be empty")
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is an existing file, not a folder; "
                                         "name a folder (it is created if missing)")
    base = _nearest_existing(path)
    if not base.is_dir():
        raise argparse.ArgumentTypeError(f"cannot create {text!r}: {str(base)!r} is a file")
    if not os.access(base, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write into {str(base)!r} (no permission); "
                                         "choose another folder")
    return path


def output_file(text: str) -> Path:
    """argparse type: a file whose parent folder exists and is writable."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the output file name must not be empty")
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; name a file inside it")
    parent = path.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"the folder {str(parent)!r} of {text!r} does not "
                                         "exist; create it first or name another file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write into {str(parent)!r} (no "
                                         "permission); choose another file")
    return path
