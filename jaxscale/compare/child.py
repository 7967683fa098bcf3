"""A compare worker process as its supervisor sees it (compare/run.py, compare/pool.py):
started with its spec on stdin, its stderr copied to ours with its last lines kept, and,
when it dies, a failed row that says how and with the runtime's last words."""
from __future__ import annotations

import collections
import json
import subprocess
import sys
import threading

from jaxscale.model import fp8, fp8_history
from jaxscale.runtime.launcher import exit_text

WORKER = (sys.executable, "-m", "jaxscale.compare.worker")


class WorkerError(RuntimeError):
    """The worker could not start (no such devices, ...); its message is for the user."""


class WorkerCrashed(WorkerError):
    """The worker's process died before it started a strategy (killed, out of memory, a
    runtime abort): the run went wrong, the options were not at fault."""


def mesh_label(plan: dict) -> str:
    """A strategy's layout in a few words, e.g. 'dp=2 tp=4 ZeRO-1 1f1b m=4'."""
    parts = [f"{a}={plan.get(a, 1)}" for a in ("dp", "ep", "cp", "tp", "pp")
             if plan.get(a, 1) > 1] or ["1 device"]
    if plan.get("sequence_parallel"):
        parts.append("sp")
    if plan["zero_stage"]:
        parts.append(f"ZeRO-{plan['zero_stage']}")
    if plan["pp"] > 1:
        parts.append(f"{plan['schedule']}" + (f" v={plan['virtual']}" if plan["virtual"] > 1
                                              else ""))
    if plan["micro_batches"] > 1:
        parts.append(f"m={plan['micro_batches']}")
    parts += [plan[k] for k in ("remat", "precision") if plan[k] not in ("none", "fp32")]
    if plan.get("fp8_block", fp8.BLOCK) != fp8.BLOCK:
        parts.append(f"tile {plan['fp8_block']}")
    if plan.get("fp8_head"):
        parts.append("FP8 head")
    if plan.get("fp8_history", fp8_history.HISTORY) != fp8_history.HISTORY:
        parts.append(f"history {plan['fp8_history']}")
    return " ".join(parts)


class Child:
    """One worker process: `spec` written to its stdin (left open when `keep_stdin`, for
    the commands that follow), its stdout for the caller to read, its stderr forwarded."""

    def __init__(self, worker, spec: dict, keep_stdin: bool = False):
        self.proc = subprocess.Popen(list(worker), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.tail: collections.deque[str] = collections.deque(maxlen=60)
        self.stderr = threading.Thread(target=_forward, args=(self.proc.stderr, self.tail),
                                       daemon=True)
        self.stderr.start()
        try:  # a worker that died at once is reported by its stdout's end, as in send()
            self.proc.stdin.write(json.dumps(spec) + "\n")
            if keep_stdin:
                self.proc.stdin.flush()
            else:
                self.proc.stdin.close()
        except OSError:
            pass

    def send(self, **command) -> None:
        """One command line; a worker that died meanwhile is reported by its stdout's end."""
        try:
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
        except OSError:
            pass

    def close(self) -> None:
        """Close its stdin: no more commands, it exits."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass

    def finish(self) -> int:
        """Close its stdin and wait for it to exit; its exit status."""
        self.close()
        rc = self.proc.wait()
        self.stderr.join(timeout=5)
        return rc

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def last_words(self) -> str:
        """The runtime's most telling line: an XLA check or rendezvous timeout, else the last."""
        for key in ("Termination timeout", "Check failed", "Fatal Python error", "Error"):
            for line in self.tail:
                if key in line:
                    return line.strip()[-300:]
        return next((ln.strip()[-300:] for ln in reversed(self.tail) if ln.strip()),
                    "no output")

    def died_in(self, name: str, plan: dict, rc: int) -> dict:
        """The failed row of the strategy this process died running."""
        return {"name": name, "status": "failed", "plan": plan, "mesh": mesh_label(plan),
                "error": f"its process died ({exit_text(rc)}): {self.last_words()}"}


def _forward(stream, tail) -> None:
    """Copy the worker's stderr to ours (progress, warnings) and keep its last lines."""
    for line in stream:
        tail.append(line.rstrip())
        sys.stderr.write(line)
