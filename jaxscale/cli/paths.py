"""Output paths checked before any work: argparse types for `--out DIR`, `--profile DIR`,
`--png FILE`, and the one probe they share.

A run that computes for a minute and then fails to write its result has lost the minute.
Permission bits do not answer "can I write here?" (root ignores them; a read-only mount,
/proc or a full quota say no whatever they are), so `writable` asks the file system itself:
it creates a probe file in the folder and removes it at once, creating nothing else.
  - a folder (`output_dir`) may not exist yet (it is created, with its parents, when the
    result is written), but it must not be an existing file, and the nearest folder above
    it that does exist must take a file;
  - a file (`output_file`) must not be an existing folder, its parent folder must already
    exist and take a file (a file option never creates folders), and its extension must be
    one of `extensions` when they are given.
"""
from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path


def nearest_existing(path: Path) -> Path:
    """`path` itself if it exists, else its nearest parent that does ('.' at worst)."""
    for parent in (path, *path.parents):
        if parent.exists():
            return parent
    return Path(".")


def writable(folder: Path) -> str | None:
    """None if a file can be created in `folder`, else why not ('Permission denied').

    Creates one uniquely named probe file in `folder` and removes it: nothing else is
    created, and nothing is left behind.
    """
    try:
        fd, probe = tempfile.mkstemp(prefix=".jaxscale-probe-", dir=folder)
    except OSError as e:
        return e.strerror or type(e).__name__
    os.close(fd)
    os.unlink(probe)
    return None


def output_dir(text: str) -> Path:
    """argparse type: a folder that exists or can be created (it is not created here)."""
    name = repr(text)
    if not text.strip():
        raise argparse.ArgumentTypeError("the output folder must not be empty")
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{name} is an existing file, not a folder; "
                                         "name a folder (it is created if missing)")
    base = nearest_existing(path)
    if not base.is_dir():
        raise argparse.ArgumentTypeError(f"cannot create {name}: {str(base)!r} is a file; "
                                         "name a folder")
    why = writable(base)
    if why:
        raise argparse.ArgumentTypeError(f"cannot write into {str(base)!r} for {name} ({why}); "
                                         "choose another folder")
    return path


def output_file(text: str, extensions: tuple[str, ...] = ()) -> Path:
    """argparse type: a file whose parent folder exists and takes files; with `extensions`
    ('png', 'svg', ...), a name ending in one of them."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the output file name must not be empty")
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; name a file inside it")
    suffix = path.suffix.lower().lstrip(".")
    if extensions and suffix not in extensions:
        got = (f"its extension {path.suffix!r} is not a format that can be written" if suffix
               else "it has no extension")
        raise argparse.ArgumentTypeError(f"{text!r}: {got}; end the name in one of "
                                         f".{', .'.join(extensions)}")
    parent = path.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"the folder {str(parent)!r} of {text!r} does not "
                                         "exist; create it first or name another file")
    why = writable(parent)
    if why:
        raise argparse.ArgumentTypeError(f"cannot write {text!r} into {str(parent)!r} ({why}); "
                                         "choose another file")
    return path
