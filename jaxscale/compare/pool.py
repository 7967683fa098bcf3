"""`jaxscale compare`'s worker pool: compile on every core, then time each row alone.

On forced CPU devices most of a comparison is XLA compiling (seconds a strategy, mostly on
one core), and the step times it reports are only true if nothing else runs while they
are taken. One worker doing a row after another leaves a core idle during every compile;
two workers each doing rows at once would time one's steps while the other compiles. So
the pool runs in two phases over k workers (compare/worker.py, on command):

  build  every idle worker takes the next strategy not yet built and builds it: compiles,
         reads its HLO and memory, trains it (compare.phases: prepare, train). The slowest
         to compile go first (a rough cost from the plan's axes) and the first worker free
         takes the next, so the workers finish together. A worker keeps each row it
         built: its executable and trained state stay in memory.
  time   once no worker is busy (every strategy built): the calibration, then each
         strategy in order, timed in the worker that holds it while the others wait on
         their stdin. Nothing else of the run executes meanwhile, and nothing is traced,
         lowered or compiled again.

A worker that dies fails the strategy it was building or timing (its exit signal and the
runtime's last words, as compare.run does); the rows it held, built but not yet timed, go
back to be built again, by a new worker if need be, before any more timing. Rows reach
`report` in the spec's order, each once it is final.
"""
from __future__ import annotations

import json
import queue
import threading
import time

from jaxscale.compare.child import Child, WorkerCrashed, WorkerError, mesh_label
from jaxscale.runtime.launcher import exit_text


def run_pool(spec: dict, report, log, worker, seen: dict) -> list[dict]:
    """Run spec["strategies"] on spec["workers"] workers (module docstring); rows in order.
    `seen` receives the calibration's window ("calibration_windows")."""
    return _Pool(spec, report, log, worker, seen).run()


class _Member:
    """One worker of the pool: what it is doing (`task`: ("setup", None) until it is
    ready, (command, strategy) while it runs one, None when idle); its stdout's events go
    to the pool's queue, then (self, None) when it ends."""

    def __init__(self, worker, spec: dict, events: queue.Queue, number: int):
        self.child = Child(worker, spec, keep_stdin=True)
        self.task: tuple[str, str | None] | None = ("setup", None)
        self.number = number
        threading.Thread(target=self._read, args=(events,), daemon=True).start()

    def _read(self, events: queue.Queue) -> None:
        for line in self.child.proc.stdout:
            try:
                events.put((self, json.loads(line)))
            except json.JSONDecodeError:
                continue  # a stray print of a library
        events.put((self, None))

    def send(self, what: str, name: str | None = None) -> None:
        self.task = (what, name)
        self.child.send(do=what, name=name)


class _Pool:
    def __init__(self, spec: dict, report, log, worker, seen: dict):
        self.spec, self.report, self.log, self.worker = {**spec, "commands": True}, report, \
            log, worker
        self.seen, self.k = seen, spec["workers"]
        self.order = [s["name"] for s in spec["strategies"]]
        self.plans = {s["name"]: s["plan"] for s in spec["strategies"]}
        self.todo = sorted(self.order, key=self._cost, reverse=True)  # not built yet
        self.held: dict[str, _Member] = {}  # built, waiting for its timing
        self.done: dict[str, dict] = {}
        self.calibration, self.calibrated = None, False
        self.events: queue.Queue = queue.Queue()
        self.members: list[_Member] = []
        self.spawned = self.builds = 0
        self.t_start = time.perf_counter()

    def run(self) -> list[dict]:
        try:
            while len(self.done) < len(self.order):
                self._staff()
                self._dispatch()
                try:
                    member, event = self.events.get(timeout=1.0)
                except queue.Empty:
                    continue
                self._handle(member, event)
        except BaseException:  # Ctrl-C, a worker's error: no worker outlives the run
            for m in self.members:
                m.child.kill()
            raise
        for m in self.members:  # no more commands: they exit, all at once
            m.child.close()
        for m in self.members:
            m.child.finish()
        return self._rows()

    def _cost(self, name: str) -> float:
        """A strategy's rough compile cost, to build the slowest first (then the quick ones
        fill the gaps and the workers finish together): each parallel axis it uses adds to
        the program, context parallelism's ring most (measured on tiny: 5 s for dp, 12 s
        for dp x tp x pp, 19 s for cp on 2 cores)."""
        p = self.plans[name]
        axes = sum(p.get(a, 1) > 1 for a in ("dp", "tp", "pp", "cp"))
        return (1 + axes + 2 * (p.get("cp", 1) > 1) + bool(p.get("sequence_parallel"))
                + 0.5 * bool(p.get("zero_stage")) + 0.5 * (p.get("micro_batches", 1) > 1))

    def _staff(self) -> None:
        """Start workers while strategies wait to be built: at most k, one a strategy."""
        while self.todo and len(self.members) < min(self.k, len(self.todo)):
            self.spawned += 1
            self.members.append(_Member(self.worker, self.spec, self.events, self.spawned))

    def _dispatch(self) -> None:
        """Build on every idle worker while strategies wait; once nobody is busy, time the
        next strategy in order (after the calibration) in the worker that holds it."""
        idle = [m for m in self.members if m.task is None]
        if self.todo:
            for m in idle[:len(self.todo)]:
                name = self.todo.pop(0)
                self.builds += 1
                self.log(f"[{self.builds}/{len(self.order)}] {name}: "
                         f"{mesh_label(self.plans[name])} ... compiling in worker {m.number} "
                         f"({time.perf_counter() - self.t_start:.0f} s elapsed)")
                m.send("build", name)
            return
        if not idle or any(m.task for m in self.members):
            return  # a worker still builds: nothing is timed
        if not self.calibrated:
            self.log(f"timing each strategy alone ({time.perf_counter() - self.t_start:.0f} "
                     "s elapsed)")
            idle[0].send("calibrate")
            return
        name = next(n for n in self.order if n not in self.done)
        self.held.pop(name).send("time", name)

    def _handle(self, m: _Member, event: dict | None) -> None:
        if event is None:
            self._ended(m)
            return
        kind = event["event"]
        if kind == "error":
            raise WorkerError(event["message"])
        if kind == "built":
            self.held[event["name"]] = m
        elif kind == "calibration":
            self.calibration, self.calibrated = event["calibration"], True
            self.seen.setdefault("calibration_windows", []).append(event["window"])
        elif kind == "row":
            self._finish(event["row"])
        m.task = None  # "ready", or the answer to its command

    def _ended(self, m: _Member) -> None:
        """A worker's stdout closed before the run let it go: it died (or never started)."""
        if m not in self.members:
            return
        rc = m.child.finish()
        self.members.remove(m)
        what, name = m.task or (None, None)
        if what == "setup":
            raise WorkerCrashed(f"the compare worker exited ({exit_text(rc)}) before it "
                                f"started a strategy: {m.child.last_words()}")
        lost = [n for n, h in self.held.items() if h is m]
        for n in lost:  # built there, never timed: to be built again before more timing
            del self.held[n]
        self.todo = sorted(self.todo + lost, key=self._cost, reverse=True)
        if what in ("build", "time"):
            self._finish(m.child.died_in(name, self.plans[name], rc))
            self.log(f"  {name} FAILED: its process died ({exit_text(rc)}); going on with the "
                     "rest" + (f", {len(lost)} to build again" if lost else ""))
        elif what == "calibrate":
            self.calibrated = True  # no time model, rather than no table
            self.log(f"  the calibration's process died ({exit_text(rc)}): no step-time "
                     "prediction")

    def _finish(self, row: dict) -> None:
        if row["status"] == "ok":
            row["calibration"] = self.calibration
        self.done[row["name"]] = row
        self.report(self._rows())

    def _rows(self) -> list[dict]:
        return [self.done[n] for n in self.order if n in self.done]
