"""Meshes: a strategy's axis sizes ("dp=2,tp=2,pp=2"), the devices laid out as a grid, and
which process each mesh position lives in.

The mesh has five named axes, `MESH_AXES` = (dp, ep, pp, cp, tp), always in that order; a
size-1 axis costs nothing. With several processes the devices are placed process by
process (`place_devices`): tp's groups, the innermost axis, stay inside a process, then
cp's and pp's, and dp spans the processes, so the chattiest collectives never leave a host.
"""
from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import AxisType, Mesh


# Mesh axes in device order: dp outermost, tp innermost, so the chatty tensor-parallel
# collectives run between neighbouring devices (on a GPU node: over NVLink), and the
# context-parallel ring (cp) next to them. Expert parallelism (ep) splits the batch like
# dp outside the experts, so it sits next to dp.
MESH_AXES = ("dp", "ep", "pp", "cp", "tp")


class MeshSpecError(ValueError):
    """A mesh spec string is malformed or does not fit the devices."""


@dataclass(frozen=True)
class MeshShape:
    """Sizes of the dp, pp, tp, cp and ep mesh axes (1 where absent)."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.tp * self.cp * self.ep

    def as_dict(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in MESH_AXES}

    def __str__(self) -> str:
        return ",".join(f"{a}={getattr(self, a)}" for a in MESH_AXES)


_ITEM = re.compile(r"^\s*([A-Za-z_]\w*)\s*=\s*(\S+?)\s*$")


def parse_mesh_spec(spec: str) -> MeshShape:
    """Parse "dp=2,tp=2,pp=2" (any subset of dp, ep, pp, cp, tp; missing axes: size 1)."""
    if not isinstance(spec, str) or not spec.strip():
        raise MeshSpecError(f"empty mesh spec {spec!r}; expected e.g. 'dp=8' or 'dp=2,tp=2,pp=2'")
    sizes: dict[str, int] = {}
    for item in spec.split(","):
        m = _ITEM.match(item)
        if not m:
            raise MeshSpecError(
                f"cannot read {item.strip()!r} in mesh spec {spec!r}; expected AXIS=SIZE "
                f"with AXIS in {', '.join(MESH_AXES)}"
            )
        axis, raw = m.groups()
        if axis not in MESH_AXES:
            raise MeshSpecError(
                f"unknown mesh axis {axis!r} in {spec!r}; valid axes: {', '.join(MESH_AXES)}"
            )
        if axis in sizes:
            raise MeshSpecError(f"mesh axis {axis!r} given twice in {spec!r}")
        if not re.fullmatch(r"[+-]?\d+", raw):
            raise MeshSpecError(f"size of {axis!r} must be a positive integer, got {raw!r}")
        size = int(raw)
        if size < 1:
            raise MeshSpecError(f"size of {axis!r} must be a positive integer, got {size}")
        sizes[axis] = size
    return MeshShape(**sizes)


def make_mesh(spec: str | MeshShape, devices: list[jax.Device] | None = None) -> Mesh:
    """A Mesh with axes (dp, ep, pp, cp, tp) over `devices` (default: all of JAX's devices).

    The product of the axis sizes must equal the number of devices. Devices of several
    processes are placed process by process (`place_devices`: tp inside a
    process, dp across). Axes are Auto, so shard_map accepts unsharded inputs and inserts
    the transfers itself.
    """
    shape = parse_mesh_spec(spec) if isinstance(spec, str) else spec
    devices = list(jax.devices() if devices is None else devices)
    if shape.size != len(devices):
        raise MeshSpecError(
            f"mesh {shape} needs {shape.size} devices but "
            f"{len(devices)} {'is' if len(devices) == 1 else 'are'} available; "
            f"make the sizes multiply to {len(devices)} (or pass --devices {shape.size})"
        )
    grid = place_devices(devices, shape)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def describe(mesh: Mesh) -> str:
    """One line: axis sizes and the platform, e.g. 'dp=4,pp=1,tp=2 on 8 cpu devices'."""
    sizes = ",".join(f"{n}={s}" for n, s in mesh.shape.items())
    platform = mesh.devices.flat[0].platform
    return f"{sizes} on {math.prod(mesh.shape.values())} {platform} devices"


def place_devices(devices, shape: MeshShape) -> np.ndarray:
    """The devices as a (dp, ep, pp, cp, tp) grid: process by process, so that tp's groups (the
    innermost axis) stay inside a process, then cp's and pp's, and dp spans the processes.

    Devices of one process keep the order given. A tp group that cannot fit inside one
    process (tp larger than, or not dividing, the devices per process) is placed anyway,
    in the same order, with a warning: it runs, but every tp all-reduce crosses processes.
    """
    devices = list(devices)
    by_process: dict[int, list] = {}
    for d in devices:
        by_process.setdefault(d.process_index, []).append(d)
    ordered = [d for p in sorted(by_process) for d in by_process[p]]
    if len(by_process) > 1:
        sizes = {len(v) for v in by_process.values()}
        k = min(sizes)
        if len(sizes) == 1 and k % shape.tp:
            warnings.warn(
                f"tp={shape.tp} does not fit inside one process ({k} devices each): every "
                "tensor-parallel all-reduce crosses processes; choose tp dividing "
                f"{k} for tp inside a process", stacklevel=2)
    return np.asarray(ordered, dtype=object).reshape(shape.dp, shape.ep, shape.pp, shape.cp,
                                                       shape.tp)


def axis_locality(grid: np.ndarray, axes=MESH_AXES) -> dict[str, str]:
    """For each mesh axis of a device grid: 'in-process' when every group along it lies
    inside one process, else 'cross-process' (size-1 axes are 'in-process')."""
    out = {}
    for i, name in enumerate(axes):
        groups = np.moveaxis(grid, i, -1).reshape(-1, grid.shape[i])
        inside = all(len({d.process_index for d in g}) == 1 for g in groups)
        out[name] = "in-process" if inside else "cross-process"
    return out


def device_process(mesh) -> list[int]:
    """The process of each device in the mesh's flat (logical id) order: replica groups
    in the HLO name devices by this position."""
    return [d.process_index for d in mesh.devices.flat]
