"""Drawn documents kept on disk, so that a new process reads its corpus back instead of
walking the automaton again.

Drawing the default corpus (8,192 training and 512 validation documents) is about 1.3 s of
Python: the automaton's states met for the first time, then the walk. Every process that
trains pays it: `jaxscale train`, each of compare's workers, every experiment, every test
that starts one. Read back, the same documents take milliseconds.

Nothing is kept until a caller names a folder (`keep_in`; runtime.compile_cache does, with
the compilation cache's folder). A file holds one stream's first n documents and is named
by all they depend on: the seed, the stream (train or validation), n, a digest of the
garden's own source files and numpy's version (the Generator's numbers). One that cannot
be read is drawn again and replaced; one is written whole or not at all.
"""
from __future__ import annotations

import functools
import hashlib
import zipfile
from pathlib import Path
from typing import Callable

import numpy as np

from jaxscale.files import replacing

FORMAT = 1
_folder: Path | None = None


def keep_in(folder: str | Path | None) -> None:
    """Keep drawn documents in `folder` from now on in this process (None: nowhere)."""
    global _folder
    _folder = None if folder is None else Path(folder)


def documents(seed: int, stream: str, n: int, draw: Callable[[], tuple[np.ndarray, ...]]
              ) -> tuple[np.ndarray, ...]:
    """The first n documents of `stream` of `seed`: read back if kept, else `draw()`'s
    (then kept, when there is a folder)."""
    path = None if _folder is None else _folder / f"{seed}-{stream}-{n}-{source_digest()}.npz"
    kept = _read(path)
    if kept is not None and len(kept) == n:
        return kept
    docs = draw()
    if path is not None and docs:
        _write(path, docs)
    return docs


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """What the documents' tokens depend on besides the seed: the garden package's source
    (the language, its words, the sampler) and numpy's version, hashed."""
    h = hashlib.sha256(f"format {FORMAT} numpy {np.__version__}".encode())
    for source in sorted(Path(__file__).parent.glob("*.py")):
        h.update(source.name.encode() + b"\0" + source.read_bytes())
    return h.hexdigest()[:20]


def _read(path: Path | None) -> tuple[np.ndarray, ...] | None:
    if path is None or not path.exists():
        return None
    try:
        with np.load(path) as kept:
            tokens, lengths = kept["tokens"], kept["lengths"]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        return None
    if tokens.dtype != np.int32 or lengths.sum() != len(tokens):
        return None
    # each its own array, as drawn ones are (not views of one buffer)
    return tuple(doc.copy() for doc in np.split(tokens, np.cumsum(lengths)[:-1]))


def _write(path: Path, docs: tuple[np.ndarray, ...]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path, "wb") as f:
        np.savez(f, tokens=np.concatenate(docs).astype(np.int32),
                 lengths=np.array([len(d) for d in docs], dtype=np.int64))
