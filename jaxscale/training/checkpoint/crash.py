"""Crash points, for tests of crash safety: a process that kills itself with SIGKILL (as
the kernel's out-of-memory killer or a preempted machine would) at a named phase of one of
its checkpoint saves, so that a test places its kills where they matter instead of at
random instants.

    JAXSCALE_CHECKPOINT_CRASH=PHASE@N     die at PHASE of this process's N-th save
    JAXSCALE_CHECKPOINT_CRASH=PHASE@N:INT press Ctrl-C there instead (SIGINT: the save
                                          must finish, then the run stop cleanly)

    start     the save has begun (the state's digests dispatched), nothing written yet
    writing   Orbax is writing the step: its temporary directory exists (a watcher thread
              fires the moment it appears; the step is never committed)
    written   the step is committed (renamed into place; async: the background write has
              finished), its file list (store.MANIFEST) not yet recorded

Unset, as in every real run, a save pays one comparison per phase.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from jaxscale.training.checkpoint.store import TMP_MARK, CheckpointError

ENV = "JAXSCALE_CHECKPOINT_CRASH"
PHASES = ("start", "writing", "written")


@dataclass(frozen=True)
class CrashPoint:
    phase: str
    save: int  # 1 = this process's first save
    signal: int = signal.SIGKILL

    def due(self, phase: str, save: int) -> bool:
        return (phase, save) == (self.phase, self.save)


def from_env() -> CrashPoint | None:
    """The crash point $JAXSCALE_CHECKPOINT_CRASH asks for (None when unset); a malformed
    value is refused by name before anything runs."""
    spec = os.environ.get(ENV, "")
    if not spec:
        return None
    point, _, how = spec.partition(":")
    phase, _, n = point.partition("@")
    if phase not in PHASES or not n.isdigit() or int(n) < 1 or how not in ("", "INT"):
        raise CheckpointError(f"{ENV}={spec!r}: give PHASE@N or PHASE@N:INT, PHASE one of "
                              f"{', '.join(PHASES)} and N >= 1 (the N-th save)")
    return CrashPoint(phase, int(n), signal.SIGINT if how else signal.SIGKILL)


def die(sig: int = signal.SIGKILL) -> None:
    os.kill(os.getpid(), sig)


def die_while_writing(directory: Path, sig: int = signal.SIGKILL) -> None:
    """Send `sig` to this process as soon as a temporary step directory appears in
    `directory` (polled every half millisecond by a daemon thread)."""
    def watch():
        while not (directory.is_dir()
                   and any(TMP_MARK in p.name for p in directory.iterdir())):
            time.sleep(0.0005)
        die(sig)
    threading.Thread(target=watch, name="jaxscale-crash-point", daemon=True).start()
