"""What a compile-only program told us, kept on disk so that the same `--target` run
compiles nothing the second time.

A program compiled for a target (libtpu's or the CUDA plugin's compile-only devices) cannot
be loaded back from JAX's persistent compilation cache: its client has no devices to load
it on (runtime.targets.UNREADABLE_ENTRY), so XLA:TPU compiled every program again in every
run (a minute for a 2,048-token flash-attention step on 2 cores). Everything jaxscale reads
of such a program is data, though: XLA's memory analysis, its cost analysis, the optimized
HLO text, or the compiler's sentence when it refuses a program too big for the chip. Those
are what this cache keeps, one JSON file per program, under the compilation cache's folder
(`targets/`; no folder, no keeping).

The key is everything that decides the compile, as JAX's own cache key is:
  the lowered program's text (StableHLO with its shardings and partition count; without
  source locations, which JAX leaves out of its key too),
  the target (generation, topology, device count; for a GPU, the device facts it compiles
  against: runtime.gpu_target_config),
  the versions of jax, jaxlib and the target's compiler (libtpu or the CUDA plugin),
  the flags the compilers read from the environment (XLA_FLAGS, LIBTPU_INIT_ARGS).
A file that cannot be read (cut short, another version's) is compiled again and replaced.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
from pathlib import Path
from types import SimpleNamespace

import jax

from jaxscale.files import write_text_atomically
from jaxscale.runtime.gpu_target_config import target_config

FOLDER = "targets"
VERSION = 1  # of the file's fields
_ENV_FLAGS = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
_COMPILERS = ("jax", "jaxlib", "libtpu", "libtpu-nightly", "jax-cuda12-plugin",
              "jax-cuda12-pjrt", "jax-cuda13-plugin", "jax-cuda13-pjrt")


class KeptProgram:
    """A compiled target program's figures: the parts of jax's `Compiled` that jaxscale
    reads (memory_analysis, cost_analysis, as_text), nothing to run."""

    def __init__(self, record: dict):
        self._record = record

    def memory_analysis(self) -> SimpleNamespace:
        return SimpleNamespace(**self._record["memory"])

    def cost_analysis(self) -> dict | None:
        return self._record["cost"]

    def as_text(self) -> str:
        return self._record["text"]


def compile_for(lowered, target) -> tuple[KeptProgram, str]:
    """(the program's figures, "compiled" when XLA compiled it now or "cache" when they were
    kept from before: the same object either way) for a program lowered on the
    compile-only devices of `target` (runtime.targets.Target). A program the
    compiler refused raises its JaxRuntimeError again from the cache, with compile_source
    "cache". (This machine's own devices need none of this: jax's cache loads their
    programs, measure.timing.compile_timed.)"""
    path = _path(lowered, target)
    record = _read(path)
    if record is not None:
        if record["refused"] is not None:
            refused = jax.errors.JaxRuntimeError(record["refused"])
            refused.compile_source = "cache"
            raise refused
        return KeptProgram(record), "cache"
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        if refusal(e) is not None:  # the chip is too small: the same next time
            _write(path, {"refused": str(e)})
        raise
    record = {"refused": None, "memory": _memory(compiled), "cost": _cost(compiled),
              "text": compiled.as_text()}  # the optimized HLO, printed once
    _write(path, record)
    return KeptProgram(record), "compiled"


def refusal(error: Exception) -> str | None:
    """The compiler's sentence when it refused a program for memory (RESOURCE_EXHAUSTED),
    else None."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text:
        return None
    said = text.split("RESOURCE_EXHAUSTED:", 1)[-1].strip().splitlines()
    return said[0] if said else text.strip()  # (a refusal with no sentence: the error)


def key(lowered, target) -> str:
    """The hex digest that names a program's file (the module docstring lists what it
    hashes)."""
    h = hashlib.sha256()
    parts = [lowered.as_text(), repr(target), *compiler_versions(),
             *(f"{name}={os.environ.get(name, '')}" for name in _ENV_FLAGS)]
    if target.platform == "cuda":
        parts.append(target_config(target.generation))
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def compiler_versions() -> tuple[str, ...]:
    """name==version of each compiler package installed here (of _COMPILERS)."""
    found = []
    for name in _COMPILERS:
        try:
            found.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return tuple(found)


def folder() -> Path | None:
    """Where the figures are kept: `targets/` in the persistent compilation cache's folder
    (runtime.compile_cache), or None when there is none."""
    cache = jax.config.jax_compilation_cache_dir
    return Path(cache) / FOLDER if cache else None


def _path(lowered, target) -> Path | None:
    where = folder()
    return None if where is None else where / f"{key(lowered, target)}.json"


def _read(path: Path | None) -> dict | None:
    if path is None or not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if record.get("version") == VERSION else None


def _write(path: Path | None, record: dict) -> None:
    """Write whole or not at all (jaxscale.files.write_text_atomically)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(path, json.dumps({"version": VERSION, **record}))


def _memory(compiled) -> dict[str, int]:
    """Every byte count of XLA's memory analysis (the buffer assignment's proto left out)."""
    stats = compiled.memory_analysis()
    return {name: int(getattr(stats, name)) for name in dir(stats)
            if name.endswith("_in_bytes")}


def _cost(compiled):
    """XLA's cost analysis as JSON holds it (a dict, or a list of dicts in older jax)."""
    cost = compiled.cost_analysis()
    return None if cost is None else json.loads(json.dumps(cost, default=float))
