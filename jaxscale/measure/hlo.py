"""Measure what XLA will do: the collectives in a program's HLO, and the bytes they move.

Collectives are read from the lowered, un-optimised HLO (`lowered.as_text(dialect="hlo")`):
there every psum / ppermute / all_gather of the program is still one op with its own
shape. (The optimised CPU HLO merges a step's psums into one tuple all-reduce, which hides
the per-tensor structure.) Bytes of an op = the bytes of its result on one device.

An op inside a loop body runs once per iteration: a `lax.scan` over L layers is an HLO
`while` whose body holds one layer's collectives. `collectives` follows the call graph from
the entry computation and gives each op the number of times it runs per step (`times`):
the product of the trip counts of the while loops around it, read from each loop's
condition (`i < N`, as JAX lowers scan and fori_loop). The text itself is read by
jaxscale.measure.hlo_parse (an optimized program's async pairs are counted at -start).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from jaxscale.measure import hlo_parse
from jaxscale.measure.hlo_parse import COLLECTIVE_OPS  # noqa: F401 - part of this API

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
               "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
               "f8e4m3fn": 1, "f8e5m2": 1}
_SHAPE = re.compile(r"(?P<dtype>[a-z]+\d*[a-z0-9]*)\[(?P<dims>[\d,]*)\]")
_PAIRS = re.compile(r"source_target_pairs=\{(?P<pairs>[\d,{}]*)\}")


@dataclass(frozen=True)
class Collective:
    op: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]  # (dtype, dims) of each result
    nbytes: int  # result bytes on one device
    pairs: tuple[tuple[int, int], ...] = ()  # collective-permute: (source, target)
    times: float = 1  # executions per run of the program (loop trip counts multiplied)
    groups: tuple[tuple[int, ...], ...] | None = ()  # replica groups (positions in the mesh);
    # () when the op has none (collective-permute), None for "every device"
    branch: int | None = None  # inside branch i of a conditional (lax.switch / cond)

    @property
    def tensor_bytes(self) -> int:
        """Result bytes without the scalars (which a compiler may fold into a tuple op:
        XLA:TPU merges the loss into the gradients' all-reduce)."""
        return sum(DTYPE_BYTES[dt] * int(np.prod(dims, dtype=np.int64))
                   for dt, dims in self.shapes if dims)


def collectives(hlo_text: str, branch_share: dict[int, float] | None = None) -> list[Collective]:
    """Every collective op in an HLO module's text, in program order, with how many times
    it runs per execution of the module (`times`; 1 outside loops).

    An op inside branch i of a conditional is counted as often as the conditional runs,
    times `branch_share[i]` (the share of runs that take branch i) when it is given: the
    HLO cannot say which branch runs, the caller may (e.g. a pipeline's tick table).
    """
    comps, entry = hlo_parse.computations(hlo_text)
    runs = hlo_parse.times_run(comps, entry) if entry else {}
    lines = [(line, n, branch) for (name, branch), n in runs.items() for line in comps[name]
             if name in comps]
    if not comps:  # not a whole module: a bare list of instructions
        lines = [(line, 1, None) for line in hlo_text.splitlines()]
    found = []
    for line, times, branch in lines:
        parsed = hlo_parse.collective_result(line)
        if parsed is None or times == 0:
            continue
        op, result = parsed
        shapes = tuple((s["dtype"], tuple(int(d) for d in s["dims"].split(",") if d))
                       for s in _SHAPE.finditer(result))
        nbytes = sum(DTYPE_BYTES[dt] * int(np.prod(dims, dtype=np.int64)) for dt, dims in shapes)
        pairs = ()
        if (p := _PAIRS.search(line)) is not None:
            pairs = tuple(tuple(int(v) for v in pair.split(","))
                          for pair in re.findall(r"\{(\d+,\d+)\}", p["pairs"]))
        groups = hlo_parse.replica_groups(line)
        if branch is not None and branch_share is not None:
            times = times * branch_share.get(branch, 0.0)
        found.append(Collective(op, shapes, nbytes, pairs, times, groups, branch))
    return found


def mesh_axes_of(c: Collective, mesh_axes: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes a collective runs over: those whose coordinate differs between the
    members of its first replica group (or the first source/target pair). Device positions
    are row-major over `mesh_axes` (e.g. {"dp": 2, "pp": 2, "tp": 2}, tp innermost)."""
    if c.groups is None:  # every device
        return tuple(n for n, size in mesh_axes.items() if size > 1)
    members = c.groups[0] if c.groups else (c.pairs[0] if c.pairs else ())
    names, sizes = list(mesh_axes), list(mesh_axes.values())
    coords = [np.unravel_index(d, sizes) for d in members]
    return tuple(n for i, n in enumerate(names) if len({x[i] for x in coords}) > 1)


def bytes_by_axis(hlo_text: str, mesh_axes: dict[str, int],
                  branch_share: dict[int, float] | None = None) -> dict[str, dict]:
    """{"tp": {op: {"count", "bytes"}}, "dp": ..., "pp+tp": ...}: per run, per device,
    ops whose results are all scalars (loss, token counts, flags) left out (a scalar a
    compiler folds into a tuple op is counted; ring_bytes_by_axis leaves it out)."""
    out: dict[str, dict] = {}
    for c in collectives(hlo_text, branch_share):
        if not any(len(d) for _, d in c.shapes) or not c.times:
            continue
        key = "+".join(mesh_axes_of(c, mesh_axes)) or "none"
        entry = out.setdefault(key, {}).setdefault(c.op, {"count": 0, "bytes": 0})
        entry["count"] += c.times
        entry["bytes"] += c.nbytes * c.times
    return out


def bytes_by_op(hlo_text: str) -> dict[str, dict[str, int]]:
    """{op: {"count": n, "bytes": total result bytes per device}} per run of the program
    (an op in a loop counted once per iteration)."""
    out: dict[str, dict[str, int]] = {}
    for c in collectives(hlo_text):
        entry = out.setdefault(c.op, {"count": 0, "bytes": 0})
        entry["count"] += c.times
        entry["bytes"] += c.nbytes * c.times
    return out


def ring_bytes_sent(hlo_text: str, k: int | None = None, skip_scalars: bool = True) -> int:
    """Bytes one device sends per run if every collective runs as a ring (see
    ring_bytes_by_op), summed over the ops; `k`: the device count, for ops over all devices."""
    return round(sum(ring_bytes_by_op(hlo_text, n_devices=k, skip_scalars=skip_scalars)
                     .values()))


def group_size(c: Collective, n_devices: int) -> int:
    """Devices one collective joins: its replica group's size (every device when it has
    none written), 2 for a permute with pairs; 1 means nothing leaves the device."""
    if c.op == "collective-permute":
        return 2 if any(s != t for s, t in c.pairs) else 1
    if c.groups is None:
        return n_devices
    return len(c.groups[0]) if c.groups else 1


def ring_bytes_by_op(hlo_text: str, branch_share: dict[int, float] | None = None,
                     skip_scalars: bool = True, n_devices: int | None = None,
                     device_process: list[int] | None = None) -> dict[str, float]:
    """{op: bytes one device sends per run} if every collective runs as a ring over its own
    replica group (size g): all-reduce of r bytes 2(g-1)/g r; all-gather to r bytes
    (g-1)/g r; reduce-scatter to r bytes (g-1) r; collective-permute r. An op over every
    device (no groups written) needs `n_devices`.

    With `device_process` (the process of each mesh position) only the bytes that leave a
    process are counted: a ring's hops from one device to the next in group order, the
    share of them that join two processes (a permute: its pairs that do), averaged over
    the groups."""
    out: dict[str, float] = {}
    for c in collectives(hlo_text, branch_share):
        if skip_scalars and not any(len(d) for _, d in c.shapes):
            continue
        if c.groups is None and n_devices is None:
            raise ValueError(f"a {c.op} runs over every device; pass n_devices")
        g = n_devices if c.groups is None else (len(c.groups[0]) if c.groups else 1)
        factor = _ring_factor(c.op, g)
        if device_process is not None:
            factor *= _crossing_share(c, device_process)
        if factor:
            out[c.op] = out.get(c.op, 0.0) + factor * c.nbytes * c.times
    return out


def ring_bytes_by_axis(hlo_text: str, mesh_axes: dict[str, int],
                       branch_share: dict[int, float] | None = None) -> dict[str, dict[str, float]]:
    """{"tp": {op: bytes one device sends per run}, "dp": ..., "pp+tp": ...}: ring_bytes_by_op
    split by the mesh axes each collective runs over (see mesh_axes_of), the scalars left
    out even inside a tuple: the figure to set beside compare.predict's "sent_by_axis"
    for an optimized program, whose compiler merges and rewrites collectives.
    `branch_share`: as for `collectives` (a pipeline's tick table says it)."""
    n = int(np.prod(list(mesh_axes.values())))
    out: dict[str, dict[str, float]] = {}
    for c in collectives(hlo_text, branch_share):
        g = group_size(c, n)
        if not c.tensor_bytes or not c.times or g < 2:
            continue
        key = "+".join(mesh_axes_of(c, mesh_axes)) or "none"
        ops = out.setdefault(key, {})
        ops[c.op] = ops.get(c.op, 0.0) + _ring_factor(c.op, g) * c.tensor_bytes * c.times
    return out


def _ring_factor(op: str, g: int) -> float:
    """Bytes one device sends per result byte when `op` runs as a ring over g devices."""
    return {"all-reduce": 2 * (g - 1) / g, "all-gather": (g - 1) / g,
            "reduce-scatter": g - 1, "collective-permute": 1,
            "all-to-all": (g - 1) / g}[op]


def _crossing_share(c: Collective, proc: list[int]) -> float:
    """The share of a collective's device-to-device sends that cross a process boundary."""
    if c.op == "collective-permute":
        hops = list(c.pairs)
    else:
        groups = [tuple(range(len(proc)))] if c.groups is None else c.groups
        hops = [(grp[i], grp[(i + 1) % len(grp)]) for grp in groups for i in range(len(grp))
                if len(grp) > 1]
    return sum(proc[a] != proc[b] for a, b in hops) / len(hops) if hops else 0.0
