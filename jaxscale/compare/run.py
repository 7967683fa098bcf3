"""`jaxscale compare`'s strategies, run in child processes that a crash cannot take the table with.

A user's comparison is precious: a strategy that brings its process down (an XLA abort, a
segfault, the out-of-memory killer) must not lose the strategies already measured. So the
command is a supervisor and its workers:

  supervisor (`run_all`, in the command's process, no JAX)  -- spawns the workers, reads one
      JSON line per event from each, hands every finished row to `on_row` at once (the
      command writes compare.json there), and when a worker dies marks the strategy it was
      running as failed, with the exit signal and the runtime's last words, then starts a
      new worker for the strategies left;
  workers (`python -m jaxscale.compare.worker`, compare/worker.py) -- force the devices,
      build the shared parameters and batches, and build and time strategies
      (compare.phases). A Python exception in one strategy becomes a failed row; the worker
      goes on with the next.

Compiling is most of the work (seconds a strategy, mostly on one core); timing a step needs
the machine quiet. With spec["workers"] = k > 1 (the command sets it to the host's cores on
forced CPU devices, `worker_count`) the rows run in two phases over a pool of k workers
(compare/pool.py): every worker compiles, reads and trains rows at once, then each row is
timed in the worker that holds it while the others wait. With one worker (one core, an
accelerator, a cluster job) it runs the strategies in order on its own.

Under several processes (`jaxscale launch`, or a cluster) every process runs this pair, and
the workers together form the jax.distributed job (spec["cluster"]); only process 0's
supervisor reports. A worker that dies there takes the job with it (its peers abort), so
there is no second worker: the strategy it ran is marked failed and the rest not run.

`wall_split` says where the run's wall time went: starting the workers, the compile phase
(every row's build windows, compare.phases), the timing phase (each row's timed steps and
the calibration, alone), and the rest.
"""
from __future__ import annotations

import json
import os
import time

from jaxscale.compare import pool
from jaxscale.compare.child import WORKER, Child, WorkerCrashed, WorkerError, mesh_label
from jaxscale.runtime.launcher import exit_text

MAX_WORKERS = 4  # each holds the forced devices, the model and its rows: memory, not cores


def worker_count(n_strategies: int, on_cpu: bool, cluster: bool) -> int:
    """Workers for a run: the host's cores (at most MAX_WORKERS and one a strategy) on
    forced CPU devices in one process; one on an accelerator (each worker would claim the
    device's memory) and in a cluster job (its processes are the job)."""
    if not on_cpu or cluster:
        return 1
    return max(1, min(len(os.sched_getaffinity(0)), MAX_WORKERS, n_strategies))


def run_all(spec: dict, on_row, log=print, worker=None, voice: dict | None = None,
            wall: dict | None = None) -> list[dict]:
    """Run spec["strategies"] ([{name, plan}]) in `worker` processes; rows in order.

    `on_row(rows)` is called with all rows so far each time one finishes or fails, and
    `log` with progress, both only in process 0 of a multi-process job; `voice["main"]`
    says whether this is process 0. `wall`, if given, receives `wall_split`'s figures."""
    voice = {"main": True} if voice is None else voice
    voice.setdefault("main", True)
    report = lambda r: voice["main"] and on_row(r)  # noqa: E731
    say = lambda m: voice["main"] and log(m)  # noqa: E731
    start, seen = time.time(), {"workers": spec.get("workers", 1)}
    if spec.get("workers", 1) > 1 and not spec.get("cluster"):
        rows = pool.run_pool(spec, report, say, worker or WORKER, seen)
    else:
        rows = _in_order(spec, report, say, worker or WORKER, voice, seen)
    if wall is not None:
        wall.update(wall_split(start, time.time(), rows, seen))
    return rows


def _in_order(spec, report, say, worker, voice, seen) -> list[dict]:
    """One worker at a time, each running the strategies left in order."""
    pending, rows = list(spec["strategies"]), []
    t_start, total = time.perf_counter(), len(pending)
    while pending:
        done = _one_worker(worker, {**spec, "strategies": pending}, rows, report, say,
                           t_start, total, voice, seen)
        pending = pending[done:]
        if pending and spec.get("cluster"):  # the job lost a process: nobody to run them
            for s in pending:
                rows.append({"name": s["name"], "status": "failed", "plan": s["plan"],
                             "mesh": mesh_label(s["plan"]),
                             "error": "not run: the multi-process job lost a process"})
            report(rows)
            break
    return rows


def _one_worker(worker, spec, rows, on_row, log, t_start, total, voice, seen) -> int:
    """Run strategies until they are done or the worker dies; returns how many it settled."""
    child = Child(worker, spec)
    settled, running = 0, None
    try:
        for line in child.proc.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue  # a stray print of a library
            if event["event"] == "error":
                raise WorkerError(event["message"])
            if event["event"] == "joined":  # one of several processes: only 0 reports
                voice["main"] = event["process"] == 0
            if event["event"] == "calibration":
                seen.setdefault("calibration_windows", []).append(event["window"])
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
        rc = child.finish()
    except BaseException:
        child.kill()
        raise
    if running is None and settled < len(spec["strategies"]):
        raise WorkerCrashed(f"the compare worker exited ({exit_text(rc)}) before it started "
                            f"a strategy: {child.last_words()}")
    if running is not None:  # the worker died inside this strategy
        rows.append(child.died_in(running, spec["strategies"][settled]["plan"], rc))
        log(f"  {running} FAILED: its process died ({exit_text(rc)})"
            + ("" if spec.get("cluster") else "; going on with the rest in a new process"))
        settled += 1
        on_row(rows)
    return settled


def wall_split(start: float, end: float, rows: list[dict], seen: dict) -> dict:
    """Where the run's wall time went, from the windows the rows and the calibration
    recorded (time.time() seconds): startup (until the first row's work began), the compile
    phase (the union of the rows' prepare and train windows, over all workers), the timing
    phase (the union of their time windows and the calibration's), other (the rest: the
    workers' exits, the supervisor); and each part of the rows' work summed over rows
    (process-seconds: with several workers these add up to more than the phase)."""
    windows = [(r.get("wall") or {}).get("windows", {}) for r in rows]
    build = [w[k] for w in windows for k in ("prepare", "train") if k in w]
    timed = [w["time"] for w in windows if "time" in w] + seen.get("calibration_windows", [])
    first = min((a for a, _ in build + timed), default=end)
    out = {"total_s": end - start, "workers": seen.get("workers", 1),
           "startup_s": max(0.0, first - start), "compile_phase_s": _union(build),
           "timing_phase_s": _union(timed)}
    out["other_s"] = out["total_s"] - out["startup_s"] - out["compile_phase_s"] \
        - out["timing_phase_s"]
    parts = ("setup_s", "lower_s", "compile_s", "hlo_s", "train_s", "timing_s")
    out["rows_s"] = {k: sum((r.get("wall") or {}).get(k, 0.0) for r in rows) for k in parts}
    out["rows_s"]["calibration_s"] = sum(b - a for a, b in seen.get("calibration_windows", []))
    return out


def _union(intervals: list[list[float]]) -> float:
    """Seconds covered by at least one of the [start, end] intervals."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total
