"""The options of a command that can run as one process of many (train, compare).

They only describe the job; `runtime.processes.from_args` checks them and `start` joins it.
"""
from __future__ import annotations

from jaxscale.cli.main import _number
from jaxscale.runtime.processes import DETECT_ENV, HEARTBEAT_S, SHUTDOWN_S


def add_arguments(parser) -> None:
    """The options of a command that can run as one process of many (train, compare)."""
    g = parser.add_argument_group(
        "several processes (jax.distributed; `jaxscale launch` sets these for local runs)")
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="address of process 0's coordinator service; with --num-processes "
                        "and --process-id. Without it, a cluster JAX recognises (SLURM, "
                        f"TPU VMs, ...) is joined by itself (set {DETECT_ENV}=off to stop "
                        "that)")
    g.add_argument("--num-processes", type=_number(), default=None, metavar="N",
                   help="processes in the job (one per host on a cluster)")
    g.add_argument("--process-id", type=_number(minimum=0), default=None, metavar="I",
                   help="this process's index, 0 to N-1; process 0 prints and writes")
    g.add_argument("--heartbeat-timeout", type=_number(), default=HEARTBEAT_S, metavar="S",
                   help="seconds a process waits for a silent peer before it aborts "
                        f"(default {HEARTBEAT_S}; JAX's own is 100)")
    g.add_argument("--shutdown-timeout", type=_number(), default=SHUTDOWN_S, metavar="S",
                   help="seconds a finished process waits at exit for the others "
                        f"(default {SHUTDOWN_S}; JAX's own is 300)")
