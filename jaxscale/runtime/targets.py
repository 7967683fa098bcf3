"""Compile-only targets: a Cloud TPU slice's devices, or NVIDIA GPUs, on a machine that
has none of them.

libtpu (the optional extra `pip install -e ".[tpu]"`) carries XLA:TPU's compiler, and
`jax.experimental.topologies.get_topology_desc` gives a slice's devices as compile-only
devices: a Mesh can be built over them and a jitted step lowered and compiled for them
(nothing runs, nothing is allocated), so that XLA:TPU's own memory analysis says whether
a layout fits the chip before anyone pays for the chip.

Names. Cloud TPU's accelerator types count chips for v5e and v6e (`v5e-256`: 256 chips,
16 x 16) but TensorCores for v5p (`v5p-512`: 256 chips of 2 cores each, run as one
device per chip, 4 x 8 x 8): the trap every first v5p user falls into. Both name forms
are taken, and an explicit topology (`v5p:4x8x8`, `v6e:8x8`) too. v4 is left out: its
compile-only topology has a device per TensorCore where a real v4 runs one per chip, so
its memory per device would not be the chip's.

libtpu looks for a TPU when it starts and writes warnings about environment variables it
cannot find (straight to the process's stderr, from C++); they mean nothing here, and
`target_devices` keeps them off the user's screen unless the call fails. It also lets
several processes load libtpu at once (none of them drives a chip).

GPUs the same way: the CUDA plugin (the optional extra `.[gpu]`) compiles for `h100-8`,
`h200-8` (one host of 8) or `h100-16` (2 hosts of 8: multi-node layouts) from the device's
facts (jaxscale.runtime.gpu_target_config); its topology string is "partitions x hosts x
devices per host".
"""
from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import re
import shutil
import tempfile
import warnings
from dataclasses import dataclass

from jaxscale.runtime.gpu_target_config import GPUS, target_config

GIB = 2**30

# generation: (HBM per chip, chips per unit of the name's number, chip shapes by count).
# HBM from the Cloud TPU system-architecture pages (v5e: 16 GiB, v5p: 95 GiB, v6e: 32 GiB);
# the one table (jaxscale.costmodel.devices reads it). XLA:TPU itself refuses a program
# above 15.75, 95.74 and 31.25 GiB ("available HBM" in its message, measured with libtpu).
_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
       256: "16x16"}
_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
       256: "4x8x8", 512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16"}
GENERATIONS = {"v5e": (16 * GIB, 1, _2D), "v6e": (32 * GIB, 1, _2D),
               "v5p": (95 * GIB, 2, _3D)}
ALIASES = {"v5litepod": "v5e", "v6litepod": "v6e"}
DEVICE_KINDS = {"v5e": "TPU v5 lite", "v6e": "TPU v6 lite", "v5p": "TPU v5"}


class TargetError(ValueError):
    """A target that is unknown, malformed, or cannot be compiled for here."""


@dataclass(frozen=True)
class Target:
    """A slice to compile for: `name` as given, its `topology` (libtpu's name), how many
    devices (chips) it has and the HBM of each."""

    name: str
    generation: str
    topology: str
    n_devices: int
    hbm_bytes: int
    platform: str = "tpu"

    @property
    def device_kind(self) -> str:
        return GPUS[self.generation]["name"] if self.platform == "cuda" \
            else DEVICE_KINDS[self.generation]


def examples() -> str:
    return ("v5e-16, v5e-256, v5p-8, v5p-512, v6e-64, a topology such as v5e:4x4 or "
            "v5p:4x8x8, or h100-8, h200-8, h100-16 (2 hosts of 8)")


def parse_target(name: str) -> Target:
    """The Target `name` stands for: GEN-N (Cloud TPU's accelerator type), GEN:AxB[xC], or
    GPU-N (N of one NVIDIA GPU kind: up to 8 on one host, else whole hosts of 8)."""
    gpu = re.fullmatch(r"(?P<gpu>h100|h200)-(?P<n>\d+)", name.strip())
    if gpu:
        n = int(gpu["n"])
        if not (n in (1, 2, 4, 8) or (n > 8 and n % 8 == 0)):
            raise TargetError(f"{name}: {gpu['gpu']}-N takes 1, 2, 4 or 8 GPUs on one host, "
                              "or whole hosts of 8 (16, 24, ...)")
        hosts, per_host = (1, n) if n <= 8 else (n // 8, 8)
        return Target(name, gpu["gpu"], f"1x{hosts}x{per_host}", n,
                      GPUS[gpu["gpu"]]["device_memory_size"], "cuda")
    m = re.fullmatch(r"(?P<gen>[a-z0-9]+)(?:-(?P<n>\d+)|:(?P<topo>\d+(?:x\d+)+))", name.strip())
    gen = m and ALIASES.get(m["gen"], m["gen"])
    if not m or gen not in GENERATIONS:
        hint = " (v4 is not offered: its compile-only devices are TensorCores, not chips)" \
            if name.startswith("v4") else ""
        raise TargetError(f"unknown target {name!r}; use one of {examples()}{hint}")
    hbm, cores, shapes = GENERATIONS[gen]
    if m["topo"]:
        dims = [int(x) for x in m["topo"].split("x")]
        if len(dims) != len(next(iter(shapes.values())).split("x")) or \
                m["topo"] not in shapes.values():
            raise TargetError(f"{gen} has no topology {m['topo']}; choose from "
                              f"{', '.join(shapes.values())}")
        return Target(name, gen, f"{gen}:{m['topo']}", math.prod(dims), hbm)
    n = int(m["n"])
    chips = n // cores
    if n % cores or chips not in shapes:
        unit = "TensorCores (2 per chip)" if cores == 2 else "chips"
        raise TargetError(f"{name}: {gen}-N counts {unit}; N is one of "
                          f"{', '.join(str(c * cores) for c in shapes)}")
    return Target(name, gen, f"{gen}:{shapes[chips]}", chips, hbm)


def check_available(target: Target) -> None:
    """Raise TargetError naming the install command when the compiler is not installed:
    libtpu for a TPU, the CUDA plugin and ptxas (the nvcc wheel) for a GPU."""
    if target.platform == "cuda":
        if not gpu_compiler_found():
            raise TargetError(f"--target {target.name} compiles with XLA:GPU, which needs the "
                              "CUDA plugin and ptxas: pip install -e \".[gpu]\" (about "
                              "1.2 GB; no GPU needed), then run again")
        return
    if importlib.util.find_spec("libtpu") is None:
        raise TargetError(f"--target {target.name} compiles with XLA:TPU, which comes with "
                          "libtpu: pip install -e \".[tpu]\" (jax[tpu] at this jax's "
                          "version), then run again")


def available_target(name: str) -> Target:
    """The Target `name` stands for, its compiler installed here (else TargetError: the
    valid names, or the install command). What every --target option checks first."""
    target = parse_target(name)
    check_available(target)
    return target


def gpu_compiler_found() -> bool:
    """Whether XLA:GPU can compile here: jax's CUDA plugin (CUDA 12 or 13) and ptxas, from
    the nvcc wheel or a CUDA toolkit on PATH."""
    plugin = any(importlib.util.find_spec(f"jax_cuda{v}_plugin") for v in (12, 13))
    try:  # CUDA 12's nvcc wheel, or CUDA 13's (nvidia.cu13, where jax looks first)
        wheel = any(importlib.util.find_spec(m) is not None
                    for m in ("nvidia.cuda_nvcc", "nvidia.cu13"))
    except ModuleNotFoundError:  # no nvidia namespace package at all
        wheel = False
    return plugin and (wheel or shutil.which("ptxas") is not None)


@contextlib.contextmanager
def _stderr_kept_back():
    """Send what the process writes to file descriptor 2 to a temporary file for the
    duration; on an exception it is attached to the error, otherwise dropped."""
    with tempfile.TemporaryFile(mode="w+b") as held:
        saved = os.dup(2)
        os.dup2(held.fileno(), 2)
        try:
            yield
        except Exception as e:
            os.dup2(saved, 2)
            held.seek(0)
            text = held.read().decode(errors="replace").strip()
            if text:
                e.add_note(f"libtpu said: {text[-2000:]}")
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


# JAX writes a compile-only program to the persistent compilation cache like any other, but
# cannot read it back: the compile-only client has no devices to load it on. Each later
# compile of the same program warns (a UserWarning of several lines) and compiles again, as
# it would without the cache. (What jaxscale reads of such a program is kept instead:
# runtime.target_cache; a program compiles again only when its kept figures are gone.)
UNREADABLE_ENTRY = ("Error reading persistent compilation cache entry .*PjRtCompiler must be "
                    "constructed with a Client")


def target_devices(target: Target) -> list:
    """The slice's compile-only devices, in libtpu's order (libtpu's start-up warnings
    kept off the screen, and JAX's warning that it cannot load their programs from the
    persistent cache: see UNREADABLE_ENTRY)."""
    check_available(target)
    warnings.filterwarnings("ignore", message=UNREADABLE_ENTRY, category=UserWarning)
    # libtpu takes /tmp/libtpu_lockfile so that two processes never drive one chip; a
    # compile-only process drives none, and a second one (a test worker, another terminal)
    # must not be refused
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    with _stderr_kept_back():
        if target.platform == "cuda":  # (the plugin's "no CUDA driver here" kept back too)
            devices = topologies.get_topology_desc(
                platform="cuda", topology=target.topology,
                target_config=target_config(target.generation)).devices
        else:
            devices = topologies.get_topology_desc(topology_name=target.topology,
                                                   platform="tpu").devices
    if len(devices) != target.n_devices:
        raise TargetError(f"libtpu gave {len(devices)} devices for {target.topology}, "
                          f"expected {target.n_devices}")
    return list(devices)
