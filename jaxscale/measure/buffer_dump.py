"""The peak's buffers from XLA's text dump, for compilers that keep the assignment back.

XLA:CPU and XLA:GPU return their buffer assignment with the compiled program
(jaxscale.measure.buffers); XLA:TPU (libtpu, compile-only devices included) returns it
empty. Every XLA compiler writes the same facts as text when asked to dump
(compiler_options={"xla_dump_to": DIR}), three files per module:

  *-live-range.txt                 the schedule's "Live ranges at T (peak):" block: every
                                   value live at the program's peak, name{index}: bytes
  *-buffer-assignment-values.txt   per value "<id name{index} @pos>", then the line
                                   "from instruction: %name = SHAPE opcode(...), metadata=
                                   {op_name=... source_file=... source_line=...}"
  *-buffer-assignment.txt          each allocation's header (parameter, maybe-live-out,
                                   constant, thread-local, else a temporary) and its values

This peak is the program's (one moment of its schedule, parameters and outputs live then
included), where the proto's is each allocation's; the rows have the same keys.
A program loaded from the persistent compilation cache is not compiled, so nothing would be
dumped; `compile_and_read` therefore compiles the program under a name of its own (a new
cache key: never a hit) and keeps that compile out of the cache.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import re
import tempfile
from pathlib import Path

import jax

_PEAK = re.compile(r"^\s*Live ranges at \d+ \(peak\):\s*$")
_LIVE = re.compile(r"^\s+(?P<name>\S+?)(?P<index>\{[\d,]*\}): (?P<bytes>\d+) bytes")
_VALUE = re.compile(r"^<\d+ (?P<name>\S+?)(?P<index>\{[\d,]*\})?(?: \(phi\))? @\d+>")
_FROM = re.compile(r"^ from instruction: %(?P<name>\S+) = (?P<shape>.*?) (?P<op>[\w-]+)\(")
_ALLOCATION = re.compile(r"^allocation \d+: size \d+, (?P<what>.*):$")
_HELD = re.compile(r"^ value: <\d+ (?P<name>\S+?)(?P<index>\{[\d,]*\})?(?: \(phi\))? @\d+>")


_FRESH = itertools.count()


def compile_and_read(jitted, *args) -> tuple:
    """(the compiled program, the peak's buffers): `jitted` compiled on `args`
    (ShapeDtypeStructs will do) with XLA's dump on, and the buffers read from the dump.
    The program is `jitted`'s under another name, so its memory analysis is the same; that
    name is taken off the buffers' op_names, which then read as the program's own."""
    def program(*a):
        return jitted(*a)
    program.__name__ = f"explain_{os.getpid()}_{next(_FRESH)}"  # its own cache key
    with tempfile.TemporaryDirectory(prefix="jaxscale-dump-") as folder, _not_kept():
        compiled = jax.jit(program).lower(*args).compile(
            compiler_options={"xla_dump_to": folder})
        rows = peak_from_dump(folder)
    wrapper = f"jit({program.__name__})/"
    return compiled, [r | {"op_name": r["op_name"].removeprefix(wrapper)} for r in rows]


@contextlib.contextmanager
def _not_kept():
    """No program compiled inside is written to the persistent cache (a one-off name)."""
    least = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)
    try:
        yield
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", least)


def peak_from_dump(folder: str | Path) -> list[dict]:
    """The values live at the peak of the biggest module dumped in `folder`, largest first
    (keys as jaxscale.measure.buffers.peak_buffers')."""
    ranges = sorted(Path(folder).glob("*-live-range.txt"), key=lambda p: p.stat().st_size)
    if not ranges:
        raise FileNotFoundError(f"no *-live-range.txt in {folder}: nothing was compiled")
    stem = str(ranges[-1])[:-len("-live-range.txt")]
    values = _values(Path(stem + "-buffer-assignment-values.txt"))
    kinds = _kinds(Path(stem + "-buffer-assignment.txt"))
    rows = []
    for name, index, size in _live_at_peak(ranges[-1]):
        key = name + _index_text(index)
        shape, op, op_name, source = values.get(key, ("?", "", "", ""))
        rows.append({"bytes": size, "kind": kinds.get(key, "temporary"),
                     "shape": _part(shape, index), "instruction": key, "opcode": op,
                     "op_name": op_name, "source": source})
    return sorted(rows, key=lambda r: (-r["bytes"], r["instruction"]))


def _index_text(index: tuple) -> str:
    return "{" + ",".join(map(str, index)) + "}" if index else ""


def _index(text: str | None) -> tuple:
    inner = (text or "{}")[1:-1]
    return tuple(int(i) for i in inner.split(",")) if inner else ()


def _live_at_peak(path: Path):
    inside = False
    for line in path.read_text().splitlines():
        if _PEAK.match(line):
            inside = True
            continue
        m = _LIVE.match(line) if inside else None
        if inside and not m:
            return
        if m:
            yield m["name"], _index(m["index"]), int(m["bytes"])


def _values(path: Path) -> dict:
    """name{index} -> (its instruction's shape text, opcode, op_name, source)."""
    out, current = {}, None
    for line in path.read_text().splitlines():
        m = _VALUE.match(line)
        if m:
            current = m["name"] + _index_text(_index(m["index"]))
            continue
        m = _FROM.match(line)
        if m and current:
            meta = line[m.end():]
            op_name = re.search(r'op_name="((?:[^"\\]|\\.)*)"', meta)
            file = re.search(r'source_file="([^"]*)"', meta)
            number = re.search(r"source_line=(\d+)", meta)
            out[current] = (m["shape"], m["op"], op_name[1] if op_name else "",
                            f"{file[1]}:{number[1] if number else '?'}" if file else "")
            current = None
    return out


def _kinds(path: Path) -> dict:
    """name{index} -> the kind of the allocation that holds it."""
    out, kind = {}, "temporary"
    for line in path.read_text().splitlines():
        m = _ALLOCATION.match(line)
        if m:
            what = m["what"]
            kind = ("argument" if "parameter" in what else "output" if "live-out" in what
                    or "output shape" in what else "constant" if "constant" in what else
                    "thread-local" if "thread-local" in what else "temporary")
            continue
        m = _HELD.match(line)
        if m:
            out[m["name"] + _index_text(_index(m["index"]))] = kind
    return out


def _part(shape: str, index: tuple) -> str:
    """HLO shape text without layouts (f32[8,128]{1,0:T(8,128)} -> f32[8,128]); for a
    tuple, the element at `index`."""
    text = re.sub(r"\{[^{}]*\}|/\*index=\d+\*/", "", shape)
    for i in index:
        if not text.startswith("("):
            break
        depth, parts, start = 0, [], 1
        for j, ch in enumerate(text[1:-1], start=1):
            if ch in "([":
                depth += 1
            elif ch in ")]":
                depth -= 1
            elif ch == "," and depth == 0:
                parts.append(text[start:j].strip())
                start = j + 1
        parts.append(text[start:-1].strip())
        text = parts[i]
    return text
