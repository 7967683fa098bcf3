"""Devices and meshes: force N host-CPU devices, build a Mesh from "dp=2,tp=2,pp=2".

On a laptop, XLA can split the host CPU into N devices; on a GPU/TPU machine the same
mesh code runs over the real accelerators. Everything here validates its input before
JAX compiles anything, so a typo costs a clear message, not a traceback.

XLA's CPU runtime and collectives (a known hazard of forced CPU devices, jaxlib 0.10).
JAX lowers every collective with the same channel id, and the CPU runtime's in-process
rendezvous is keyed by (run, device group, kind, channel id). Its executor orders
collectives only by when they START: a while loop or conditional that still has
collectives running (multi-threaded kernels leave it pending) does not stop a later,
independent collective of the same kind over the same devices from starting. The two then
meet in one rendezvous and the process aborts ("Check failed: id < num_threads ...
RendezvousKey{..., op_id=1}"). It is rare and timing-dependent: no flag turns it off
(xla_cpu_use_thunk_runtime=false is no longer honoured). jaxscale keeps such collectives
data-dependent where it can (ZeRO-3's units), and the test suite runs a test whose worker
crashed once more (pyproject.toml); GPU and TPU runtimes do not share the hazard.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

# Mesh axes in device order: dp outermost, tp innermost, so the chatty tensor-parallel
# collectives run between neighbouring devices (on a GPU node: over NVLink).
MESH_AXES = ("dp", "pp", "tp")


class DeviceError(ValueError):
    """The requested devices cannot be provided."""


class MeshSpecError(ValueError):
    """A mesh spec string is malformed or does not fit the devices."""


def _backend_started() -> bool:
    from jax._src import xla_bridge  # no public API tells whether backends exist yet

    return xla_bridge.backends_are_initialized()


def force_cpu_devices(n: int) -> list[jax.Device]:
    """Split the host CPU into `n` XLA devices and return them.

    Must run before JAX starts its backend (before the first array is made). Afterwards
    the device count is fixed: asking for a different one raises DeviceError instead of
    being silently ignored, which is what the XLA flag would do.
    """
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
        raise DeviceError(f"device count must be a positive integer, got {n!r}")
    n = int(n)
    if _backend_started():
        have = len(jax.devices("cpu"))
        if have != n:
            raise DeviceError(
                f"asked for {n} CPU devices but JAX's backend already started with {have}; "
                "call force_cpu_devices (or pass --devices) before any JAX computation, "
                "or start a fresh process"
            )
    else:
        jax.config.update("jax_num_cpu_devices", n)
    devices = jax.devices("cpu")
    if len(devices) != n:  # e.g. a platform that ignores the setting
        raise DeviceError(f"asked for {n} CPU devices, JAX provides {len(devices)}")
    return devices


@dataclass(frozen=True)
class MeshShape:
    """Sizes of the dp, pp and tp mesh axes (1 where absent)."""

    dp: int = 1
    pp: int = 1
    tp: int = 1

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.tp

    def as_dict(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in MESH_AXES}

    def __str__(self) -> str:
        return ",".join(f"{a}={getattr(self, a)}" for a in MESH_AXES)


_ITEM = re.compile(r"^\s*([A-Za-z_]\w*)\s*=\s*(\S+?)\s*$")


def parse_mesh_spec(spec: str) -> MeshShape:
    """Parse "dp=2,tp=2,pp=2" (any subset of dp, pp, tp; missing axes have size 1)."""
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
    """A Mesh with axes (dp, pp, tp) over `devices` (default: all of JAX's devices).

    The product of the axis sizes must equal the number of devices. Axes are Auto, so
    shard_map accepts unsharded inputs and inserts the transfers itself.
    """
    shape = parse_mesh_spec(spec) if isinstance(spec, str) else spec
    devices = list(jax.devices() if devices is None else devices)
    if shape.size != len(devices):
        raise MeshSpecError(
            f"mesh {shape} needs {shape.size} devices but {len(devices)} are available; "
            f"make the sizes multiply to {len(devices)} (or pass --devices {shape.size})"
        )
    grid = np.asarray(devices, dtype=object).reshape([getattr(shape, a) for a in MESH_AXES])
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def describe(mesh: Mesh) -> str:
    """One line: axis sizes and the platform, e.g. 'dp=4,pp=1,tp=2 on 8 cpu devices'."""
    sizes = ",".join(f"{n}={s}" for n, s in mesh.shape.items())
    platform = mesh.devices.flat[0].platform
    return f"{sizes} on {math.prod(mesh.shape.values())} {platform} devices"
