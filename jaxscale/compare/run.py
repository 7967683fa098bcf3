"""`jaxscale compare`'s strategies, run in a child process that a crash cannot take the table with.

A user's comparison is precious: a strategy that brings its process down (an XLA abort, a
segfault, the out-of-memory killer) must not lose the strategies already measured. So the
command is two processes:

  supervisor (`run_all`, in the command's process)  -- spawns the worker, reads one JSON
      line per event from it, hands every finished row to `on_row` at once (the command
      writes compare.json there), and when the worker dies marks the strategy it was
      running as failed, with the exit signal and the runtime's last words, then starts a
      new worker for the strategies left;
  worker (`python -m jaxscale.compare.worker`, compare/worker.py) -- forces the devices,
      builds the shared parameters and batches, and runs the strategies in order
      (compare.run_strategy), printing a row as each one finishes. A Python exception in
      one strategy becomes a failed row; the worker goes on with the next.

Cost: one extra process start (about 2-3 s: Python, JAX, the corpus) per worker; one worker
unless a strategy crashes.

Under several processes (`jaxscale launch`, or a cluster) every process runs this pair, and
the workers together form the jax.distributed job (spec["cluster"]); only process 0's
supervisor reports. A worker that dies there takes the job with it (its peers abort), so
there is no second worker: the strategy it ran is marked failed and the rest not run.
"""
from __future__ import annotations

import collections
import json
import subprocess
import sys
import threading
import time

from jaxscale.runtime.launcher import exit_text

WORKER = (sys.executable, "-m", "jaxscale.compare.worker")


def mesh_label(plan: dict) -> str:
    """A strategy's layout in a few words, e.g. 'dp=2 tp=4 ZeRO-1 1f1b m=4'."""
    parts = [f"{a}={plan.get(a, 1)}" for a in ("dp", "cp", "tp", "pp")
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
    return " ".join(parts)


class WorkerError(RuntimeError):
    """The worker could not start (no such devices, ...); its message is for the user."""


def run_all(spec: dict, on_row, log=print, worker=None, voice: dict | None = None) -> list[dict]:
    """Run spec["strategies"] ([{name, plan}]) in `worker` processes; rows in order.

    `on_row(rows)` is called with all rows so far each time one finishes or fails, and
    `log` with progress, both only in process 0 of a multi-process job; `voice["main"]`
    says whether this is process 0."""
    pending = list(spec["strategies"])
    rows: list[dict] = []
    voice = {"main": True} if voice is None else voice
    voice.setdefault("main", True)
    report = lambda r: voice["main"] and on_row(r)  # noqa: E731
    say = lambda m: voice["main"] and log(m)  # noqa: E731
    t_start = time.perf_counter()
    total = len(pending)
    while pending:
        done = _one_worker(worker or WORKER, {**spec, "strategies": pending}, rows, report, say,
                           t_start, total, voice)
        pending = pending[done:]
        if pending and spec.get("cluster"):  # the job lost a process: nobody to run them
            for s in pending:
                rows.append({"name": s["name"], "status": "failed", "plan": s["plan"],
                             "mesh": mesh_label(s["plan"]),
                             "error": "not run: the multi-process job lost a process"})
            report(rows)
            break
    return rows


def _one_worker(worker, spec, rows, on_row, log, t_start, total, voice) -> int:
    """Run strategies until they are done or the worker dies; returns how many it settled."""
    proc = subprocess.Popen(list(worker), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    tail: collections.deque[str] = collections.deque(maxlen=60)
    reader = threading.Thread(target=_forward, args=(proc.stderr, tail), daemon=True)
    reader.start()
    proc.stdin.write(json.dumps(spec) + "\n")
    proc.stdin.close()
    settled, running = 0, None
    try:
        for line in proc.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue  # a stray print of a library
            if event["event"] == "error":
                raise WorkerError(event["message"])
            if event["event"] == "joined":  # one of several processes: only 0 reports
                voice["main"] = event["process"] == 0
            if event["event"] == "start":
                running = event["name"]
                i = len(rows) + 1
                elapsed = time.perf_counter() - t_start
                eta = (f", about {elapsed / (i - 1) * (total - i + 1):.0f} s left" if i > 1
                       else "")
                log(f"[{i}/{total}] {running}: {event['mesh']} ... ({elapsed:.0f} s elapsed"
                    f"{eta})")
            elif event["event"] == "row":
                rows.append(event["row"])
                settled, running = settled + 1, None
                on_row(rows)
        rc = proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    reader.join(timeout=5)
    if running is None and settled < len(spec["strategies"]):
        raise WorkerError(f"the compare worker exited ({exit_text(rc)}) before it started "
                          f"a strategy: {_last_words(tail)}")
    if running is not None:  # the worker died inside this strategy
        plan = spec["strategies"][settled]["plan"]
        rows.append({"name": running, "status": "failed", "plan": plan,
                     "mesh": mesh_label(plan),
                     "error": f"its process died ({exit_text(rc)}): {_last_words(tail)}"})
        log(f"  {running} FAILED: its process died ({exit_text(rc)})"
            + ("" if spec.get("cluster") else "; going on with the rest in a new process"))
        settled += 1
        on_row(rows)
    return settled


def _forward(stream, tail) -> None:
    """Copy the worker's stderr to ours (progress, warnings) and keep its last lines."""
    for line in stream:
        tail.append(line.rstrip())
        sys.stderr.write(line)


def _last_words(tail) -> str:
    """The runtime's most telling line: an XLA check or rendezvous timeout, else the last."""
    for key in ("Termination timeout", "Check failed", "Fatal Python error", "Error"):
        for line in tail:
            if key in line:
                return line.strip()[-300:]
    return next((ln.strip()[-300:] for ln in reversed(tail) if ln.strip()), "no output")
