"""Devices and meshes: force N host-CPU devices, build a Mesh from "dp=2,tp=2,pp=2".

On a laptop, XLA can split the host CPU into N devices; on a GPU/TPU machine the same
mesh code runs over the real accelerators. Everything here validates its input before
JAX compiles anything, so a typo costs a clear message, not a traceback.

XLA's CPU runtime and its thread pools (jaxlib 0.10; measured, see
benchmarks/runtime_stability.py). The CPU client runs every forced device's program on two
thread pools whose size is read once, when the client starts, from the `PJRT_NPROC`
environment variable, else max(cores, devices): 8 threads for 8 devices on 2 cores. A
collective holds its thread until every participant has arrived, and a while or
conditional thunk lets the device start its next collective while the loop body still
runs, so one device can hold two or three threads at once. When all threads of the pool
wait inside collectives, the devices that have not yet arrived find no thread to run on:
the rendezvous times out and XLA aborts the process ("Termination timeout for `all reduce
RendezvousKey{...}` ... only 3 of them arrived"). A warm compilation cache makes it
likelier (programs start closer together). No XLA flag orders collectives, and
`lax.optimization_barrier` is gone from the optimized CPU program, so no barrier can keep
a device from holding several threads. The cure is enough threads: `cpu_runtime_threads(n)` per pool, set
by `force_cpu_devices` before the backend starts (a `PJRT_NPROC` the user set wins).
A second hazard, which more threads make likelier: JAX lowers every collective with
channel id 1, so two collectives of one kind over the same devices that are in flight at
once on a device share one rendezvous key and the process aborts ("Check failed: id <
num_threads"). Programs must order such collectives by data dependencies (ZeRO-3 does:
`parallel.zero.forward_gathered`). GPU and TPU runtimes do not share either hazard.
"""
from __future__ import annotations

import os

import jax
import numpy as np


# Threads per forced device in each of the CPU runtime's pools: a device holds up to three
# at once (a collective inside a loop body, the next one, the loop itself); one spare.
THREADS_PER_DEVICE = 4
# Forced CPU devices time-share the host's cores and each costs THREADS_PER_DEVICE threads in
# each of two pools; past this many a step is seconds of scheduling (a bare 1,000-device
# all-reduce takes 0.6 s on 2 cores) and teaches nothing a smaller mesh does not.
MAX_CPU_DEVICES = 512


class DeviceError(ValueError):
    """The requested devices cannot be provided."""


def _backend_started() -> bool:
    from jax._src import xla_bridge  # no public API tells whether backends exist yet

    return xla_bridge.backends_are_initialized()


def cpu_runtime_threads(n_devices: int) -> int:
    """Threads for each of XLA CPU's two pools so that n forced devices never starve a
    collective of a thread (see the module docstring): the cores for one device."""
    cores = os.cpu_count() or 1
    return cores if n_devices <= 1 else max(cores, THREADS_PER_DEVICE * n_devices)


def check_cpu_count(n) -> int:
    """n, if this host can run n forced CPU devices; else DeviceError saying why."""
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
        raise DeviceError(f"device count must be a positive integer, got {n!r}")
    if n > MAX_CPU_DEVICES:
        raise DeviceError(
            f"{n} forced CPU devices is more than this host can run: at most "
            f"{MAX_CPU_DEVICES} (each one time-shares the {os.cpu_count()} cores and needs "
            f"{THREADS_PER_DEVICE} threads in each of XLA's two CPU thread pools); use fewer "
            "devices, or real accelerators")
    return int(n)


def configure_cpu_runtime(n: int) -> None:
    """Before the backend starts: n forced CPU devices and thread pools big enough for
    their collectives (PJRT_NPROC, unless the user set it)."""
    n = check_cpu_count(n)
    os.environ.setdefault("PJRT_NPROC", str(cpu_runtime_threads(n)))
    jax.config.update("jax_num_cpu_devices", n)


def force_cpu_devices(n: int) -> list[jax.Device]:
    """Split the host CPU into `n` XLA devices and return them.

    Must run before JAX starts its backend (before the first array is made). Afterwards
    the device count is fixed: asking for a different one raises DeviceError instead of
    being silently ignored, which is what the XLA flag would do.
    """
    n = check_cpu_count(n)
    if _backend_started():
        have = len(jax.devices("cpu"))
        if have != n:
            raise DeviceError(
                f"asked for {n} CPU devices but JAX's backend already started with {have}; "
                "call force_cpu_devices (or pass --devices) before any JAX computation, "
                "or start a fresh process"
            )
    else:
        if not accelerator_installed():  # (libtpu without chips would look for them, and
            jax.config.update("jax_platforms", "cpu")  # write warnings to stderr)
        configure_cpu_runtime(n)
    devices = jax.devices("cpu")
    if len(devices) != n:  # e.g. a platform that ignores the setting
        raise DeviceError(f"asked for {n} CPU devices, JAX provides {len(devices)}")
    return devices


# --platform: where a command runs. auto: the accelerators if JAX has any, else the CPU.
PLATFORMS = ("auto", "cpu", "gpu", "tpu")


def pick_devices(platform: str = "auto", n: int | None = None) -> list[jax.Device]:
    """The devices a command runs on, chosen before JAX's backend starts where it can be.

    cpu: n forced host-CPU devices (JAX is told to start no accelerator, so a GPU machine
    can run the CPU path too); auto: the accelerators when there are any, else n forced
    CPU devices; gpu / tpu: the first n of that platform's devices (all of them when n is
    None), and a clear DeviceError when there are none or too few. n None on the CPU: the
    devices the backend has (one unless forced)."""
    if platform not in PLATFORMS:
        raise DeviceError(f"unknown platform {platform!r}; choose from {', '.join(PLATFORMS)}")
    started = _backend_started()
    if platform == "cpu" or platform == "auto":
        if not started:
            if platform == "cpu" or not accelerator_installed():  # (libtpu without chips
                jax.config.update("jax_platforms", "cpu")  # would look for them, and warn)
            configure_cpu_runtime(n or 1)  # used only if the CPU is all there is
        if platform == "cpu" or jax.default_backend() == "cpu":
            return jax.devices("cpu") if n is None else force_cpu_devices(n)
        found = jax.devices()
    else:
        if platform == "tpu" and not started and not tpu_chips_present():
            raise DeviceError("--platform tpu: no tpu devices here (no TPU chips on this "
                              "machine; to compile for a TPU slice without one, use compare "
                              f"--abstract --target); choose from {', '.join(PLATFORMS)} "
                              "(auto: an accelerator if present, else the CPU)")
        if not started:  # only this accelerator (and the host CPU beside it)
            jax.config.update("jax_platforms", f"{platform},cpu")
        try:
            found = jax.devices(platform)
        except RuntimeError as e:
            reason = ("no GPU or TPU plugin for JAX is installed" if not accelerator_installed()
                      else str(e).splitlines()[0].split(" (set JAX_PLATFORMS")[0][:160])
            raise DeviceError(f"--platform {platform}: no {platform} devices here ({reason}); "
                              f"choose from {', '.join(PLATFORMS)} (auto: an accelerator if "
                              "present, else the CPU)") from None
    if n is not None and len(found) < n:
        raise DeviceError(f"{n} devices asked for, but only {len(found)} "
                          f"{found[0].platform} device{'s are' if len(found) > 1 else ' is'} "
                          "present")
    return found if n is None else found[:n]


def accelerator_installed() -> bool:
    """Whether a GPU or TPU plugin for JAX is installed (without starting any backend,
    which would be too late for jax.distributed.initialize). libtpu counts only on a
    machine with TPU chips: installed for compile-only targets (jaxscale.runtime.targets)
    on a laptop, it is not an accelerator."""
    from importlib import metadata
    names = {(d.metadata["Name"] or "").lower() for d in metadata.distributions()}
    return any(n.startswith(("jax-cuda", "jax_cuda", "jax-rocm")) for n in names) or (
        "libtpu" in names and tpu_chips_present())


def tpu_chips_present() -> bool:
    """Whether this machine has TPU chips: the device files a TPU VM exposes (/dev/accel*
    on v4 and v5e, /dev/vfio/N on v5p and v6e)."""
    import glob
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))
