"""Several processes, one mesh: jax.distributed start-up and where each device sits.

Real clusters run JAX's multi-controller runtime: one Python process per host (here: per
group of forced CPU devices), every process runs the same program, and `jax.devices()` is
the global list. One process hosts the coordinator service; the others connect to it at
start-up, then the compiled programs' collectives run between the devices directly (on
CPU over gloo, on GPU over NCCL, on TPU over ICI/DCN). jaxscale adds no process group and
no sockets of its own: `start` calls `jax.distributed.initialize`, and everything after it
is the one-process code over a bigger mesh.

Three things change with several processes, and this module owns them:
  - start-up (`Cluster`, `start`): who the coordinator is, how many processes, which one
    this is, and how long to wait for a silent peer (the heartbeat) or for the others at
    exit (the shutdown barrier). JAX's defaults (100 s and 300 s) suit a cluster; a local
    run wants to know within seconds that a peer died.
  - placement (`place_devices`): which device takes which mesh coordinate. tp is the
    chattiest axis (two all-reduces per layer, forward and backward), so its groups must
    stay inside a process (a node's NVLink), then pp's; dp, which talks once per step,
    spans the processes. Device ids are not contiguous across processes (2 x 4 gives ids
    0-3 and 2048-2051), so placement goes by `process_index`, never by id arithmetic.
  - one voice (`is_main`, `agree`): only process 0 prints and writes; decisions (stop
    early, stop on a NaN) are taken on process 0 and broadcast, so no process waits forever
    in a collective that a peer which already stopped will never join.

`jax.distributed.initialize` may be called only from an entry point, before the first
computation (STYLE.md): the CLI's train and compare call `start` in their worker.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

import numpy as np

from jaxscale.runtime import devices as devlib

# Short enough that a local run learns within seconds that a peer died, long enough that
# a loaded 2-core laptop does not miss a heartbeat while it compiles.
HEARTBEAT_S = 10
SHUTDOWN_S = 30
INIT_S = 60  # how long to wait for every process to reach the coordinator
DETECT_ENV = "JAXSCALE_DISTRIBUTED"  # "off": never start jax.distributed by detection


class DistributedError(ValueError):
    """A multi-process option is inconsistent (bad address, process id out of range, ...)."""


@dataclass(frozen=True)
class Cluster:
    """How this process joins the job. coordinator None: detected from the environment
    (SLURM, TPU VMs, ...) by `jax.distributed.initialize` itself."""

    coordinator: str | None
    num_processes: int | None
    process_id: int | None
    heartbeat_s: int = HEARTBEAT_S
    shutdown_s: int = SHUTDOWN_S


_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+):(\d+)$")


def from_args(args) -> Cluster | None:
    """The Cluster the options describe (None: a single process), checked before JAX
    starts: all three of coordinator, count and id, or none; an id in range; HOST:PORT."""
    given = {k: getattr(args, k, None) for k in ("coordinator", "num_processes", "process_id")}
    timeouts = dict(heartbeat_s=getattr(args, "heartbeat_timeout", HEARTBEAT_S),
                    shutdown_s=getattr(args, "shutdown_timeout", SHUTDOWN_S))
    if all(v is None for v in given.values()):
        name = detected_cluster()
        return None if name is None else Cluster(None, None, None, **timeouts)
    missing = [k for k, v in given.items() if v is None]
    if missing:
        raise DistributedError(
            "--coordinator, --num-processes and --process-id go together; missing "
            + ", ".join("--" + m.replace("_", "-") for m in missing))
    m = _ADDRESS.match(given["coordinator"])
    if not m or not 0 < int(m.group(2)) < 65536:
        raise DistributedError(f"--coordinator must be HOST:PORT with a port 1-65535, got "
                               f"{given['coordinator']!r}")
    n, i = given["num_processes"], given["process_id"]
    if not 0 <= i < n:
        raise DistributedError(f"--process-id {i} is out of range for --num-processes {n}: "
                               f"use 0 to {n - 1}")
    return Cluster(given["coordinator"], n, i, **timeouts)


def detected_cluster() -> str | None:
    """The name of a cluster environment jax.distributed would join by itself (e.g.
    'slurm'), unless JAXSCALE_DISTRIBUTED=off; None on a plain machine."""
    if os.environ.get(DETECT_ENV, "").lower() == "off":
        return None
    try:  # JAX has no public probe; its own detection loop, minus opt-in methods
        from jax._src.clusters import ClusterEnv
        return next((c.name for c in ClusterEnv._cluster_types
                     if not c.opt_in_only_method and c.is_env_present()), None)
    except Exception:  # noqa: BLE001 - a probe that fails means: no cluster detected
        return None


def local_device_count(cluster: Cluster, n_devices: int) -> int:
    """Forced CPU devices each process holds when the job has n_devices in all."""
    if cluster.num_processes is None:
        raise DistributedError("--devices (forced CPU devices) needs --num-processes to be "
                               "split over the processes; on a cluster, leave --devices out")
    if n_devices % cluster.num_processes:
        raise DistributedError(
            f"--devices {n_devices} does not split evenly over {cluster.num_processes} "
            f"processes; use a multiple of {cluster.num_processes}")
    return n_devices // cluster.num_processes


def start(cluster: Cluster, n_devices: int | None = None) -> None:
    """Join the job: force this process's share of n_devices CPU devices (None: use the
    accelerators), choose gloo for CPU collectives, then jax.distributed.initialize."""
    import jax
    if n_devices is not None:  # a job of forced CPU devices: no accelerator is started,
        jax.config.update("jax_platforms", "cpu")  # whatever is installed (as --platform cpu)
        devlib.configure_cpu_runtime(local_device_count(cluster, n_devices))
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        keep_stdout_for_python()
    jax.distributed.initialize(cluster.coordinator, cluster.num_processes, cluster.process_id,
                               initialization_timeout=INIT_S,
                               heartbeat_timeout_seconds=cluster.heartbeat_s,
                               shutdown_timeout_seconds=cluster.shutdown_s)


LAUNCHED_ENV = "JAXSCALE_LAUNCHED"  # set by `jaxscale launch` in every process it starts
SUPERVISED_ENV = "JAXSCALE_SUPERVISED"  # set by `train --max-restarts` in the child it runs


def die_with_parent() -> None:
    """Under `jaxscale launch` or `train --max-restarts` (Linux): ask the kernel to SIGKILL
    this process when its parent dies, so that a launcher or supervisor killed outright
    leaves no process behind. Elsewhere, and outside them, nothing."""
    if (not (os.environ.get(LAUNCHED_ENV) or os.environ.get(SUPERVISED_ENV))
            or not os.uname().sysname == "Linux"):
        return
    import ctypes
    import signal
    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:  # the parent died before the request: too late to be told
        os._exit(1)


def is_main() -> bool:
    """True in process 0 (and in a single process): the one that prints and writes."""
    import jax
    return jax.process_index() == 0


def agree(value: bool) -> bool:
    """Process 0's `value`, on every process (itself in a single process): decisions are
    taken once and broadcast, never separately per process."""
    import jax
    if jax.process_count() == 1:
        return bool(value)
    from jax.experimental import multihost_utils
    return bool(multihost_utils.broadcast_one_to_all(np.asarray(value, dtype=np.int32)))


def named_host_arrays(tree) -> dict[str, np.ndarray]:
    """Every leaf of a tree of (global) arrays as a whole numpy array on this host, by its
    path ('blocks/0/attn/kernel'). An array split over several processes is gathered: a
    collective, so every process that holds part of it must call this too."""
    import jax

    def host(x):
        if x.is_fully_addressable:
            return np.asarray(jax.device_get(x))
        if x.is_fully_replicated:  # every process has it whole: no collective needed
            return np.asarray(x.addressable_shards[0].data)
        from jax.experimental import multihost_utils  # a collective: every process calls it
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    flat = jax.tree_util.tree_flatten_with_path(jax.tree.map(host, tree))[0]
    return {jax.tree_util.keystr(path, simple=True, separator="/"): np.asarray(v)
            for path, v in flat}


def replicated(tree):
    """Every leaf that spans several processes, copied whole onto each device of its mesh
    (one gather); leaves held by this process alone are returned as they are.

    For evaluation: a program that reads ZeRO-3's dp-sharded parameters gathers each one
    inside, and across processes on CPU those gathers go over gloo, one per parameter:
    4.6-5.4 s per validation batch of the tiny model on 2 processes x 2 devices, measured,
    against 0.02-0.05 s once the parameters are whole everywhere (the gather: 0.6 s, once
    per evaluation)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    def whole(x):
        if x.is_fully_addressable or x.is_fully_replicated:
            return x
        return jax.device_put(x, NamedSharding(x.sharding.mesh, PartitionSpec()))
    return jax.tree.map(whole, tree)


def keep_stdout_for_python() -> None:
    """Point file descriptor 1 at stderr and give Python's stdout the original: gloo's C++
    code prints its connection chatter ("[Gloo] Rank 0 is connected ...") to fd 1, which
    would break `--json` and the compare worker's event stream."""
    import sys
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(saved, "w", buffering=1)
