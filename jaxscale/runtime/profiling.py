"""Profiling: a jax.profiler trace of a few steps, and the busiest ops read back from it.

A trace records what every thread and device did, event by event, while it ran. Start it
after the step has compiled and run once, so the trace holds steady-state steps only:

    prof = Profiler(args.profile)             # None: every method does nothing, at no cost
    state, metrics = step(state, batch)       # compile and warm up outside the trace
    with prof.trace():                        # stops the trace even if a step raises
        for i in range(5):
            with prof.step(i):                # a "train" event with step_num=i
                state, metrics = step(state, batch)
                jax.block_until_ready(metrics)
    print(top_ops(args.profile))  # [OpTime('all-reduce', total_ms=44.4, count=6, ...

Block inside the step: JAX dispatches asynchronously, and an annotation closed before the
devices finish times only the dispatch. What jax 0.10.2 writes into DIR:

    DIR/plugins/profile/2026_12_02_00_20_56/   one folder per trace, named by the local
                                               second it was written (the TensorBoard layout)
        <host>.xplane.pb          the XSpace protobuf: planes of lines of events. TensorBoard
                                  and `top_ops` read this; <host> is the machine's name
        <host>.trace.json.gz      the same timeline as Chrome trace-event JSON
        perfetto_trace.json.gz    that JSON less its "metadata" field, which Perfetto's
                                  importer rejects (written when perfetto=True, the default)

Open it with `tensorboard --logdir DIR` and the profile plugin (pip packages tensorboard
and tensorboard-plugin-profile; the same plugin ships alone as xprof): Profile tab, then
trace_viewer. Or drop perfetto_trace.json.gz onto https://ui.perfetto.dev. Two traces
written in one second would share a folder, the second replacing the first, so `stop`
waits for the next second when the current one's folder exists. With several processes
on one machine give each its own DIR: they write the same <host> file names.

What is in it on CPU (seen with forced host devices): one plane "/host:CPU", a line per
thread. The main thread's ("python") holds dispatch and the "train" step events; the XLA
ops run on pool threads ("tf_XLAPjRtCpuClient/<id>"), each an event named after its HLO
instruction, with stats hlo_op, hlo_module and device_ordinal (no line per device: each
op names its device). A collective is such an event on every device (psum's all-reduce
reads "psum_invariant.7" or "all-reduce"); its time includes the wait at the rendezvous
for the slowest device, so on CPU a device's idle gap shows up inside its collectives.
A loop's op (while.209) encloses its body's ops on the same thread, so `top_ops` counts
self time (an op's time less that of the ops nested in it) and the shares add up to one.
On GPU (from the XPlane layout, untested here) ops are on "/device:GPU:N" planes: an
"XLA Ops" line where the file has one, else the kernels, which carry hlo_op.

Costs on 2 CPU cores (tiny model, dp=2, 3 steps): start 0.1-3 ms; stop 0.2 s to write
1.7 MB, 0.2 s more for the Perfetto copy; reading back 0.1 s. Python tracing (python=True)
makes every Python call an event, and Python 5-10x slower: off by default.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import jax

STEP_NAME = "train"  # the step events' name (step_num is what makes them steps)
RUNS = Path("plugins", "profile")  # where the trace folders lie inside DIR
STAMP = "%Y_%m_%d_%H_%M_%S"  # a trace folder's name: the local time it was written


class Profiler:
    """Traces with jax.profiler into `directory`; with None, every method does nothing."""

    def __init__(self, directory: str | Path | None, perfetto: bool = True,
                 python: bool = False):
        self.directory = None if directory is None else _made(Path(directory))
        self.perfetto = perfetto  # also write perfetto_trace.json.gz (doubles stop's time)
        self.python = python  # trace every Python call too (slows Python down 5-10x)
        self.running = False
        self.files: list[Path] = []  # what the last stop() wrote

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    def start(self) -> None:
        """Begin a trace. Call it after compiling and a warm-up step: compiling is not
        what a trace of training is for, and it would dwarf the steps."""
        if not self.enabled:
            return
        if self.running:
            raise RuntimeError(f"a trace into {self.directory} is already running")
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = int(self.python)
        try:
            jax.profiler.start_trace(self.directory, create_perfetto_trace=self.perfetto,
                                     profiler_options=options)
        except RuntimeError as e:  # JAX runs one trace at a time, in the whole process
            raise RuntimeError(f"cannot start a trace into {self.directory}: {e}") from e
        self.running = True

    def stop(self) -> list[Path]:
        """End the trace and write it; returns the files of its folder (also `files`)."""
        if not self.enabled:
            return []
        if not self.running:
            raise RuntimeError(f"stop() without start(): no trace into {self.directory}")
        while (self.directory / RUNS / time.strftime(STAMP)).exists():
            time.sleep(0.02)  # this second's folder exists: wait, or it is overwritten
        self.running = False
        try:
            jax.profiler.stop_trace()
        except Exception as e:
            raise RuntimeError(f"the trace into {self.directory} was not written: {e}") from e
        written = _newest(self.directory)
        self.files = sorted(written.parent.iterdir()) if written else []
        return self.files

    @contextlib.contextmanager
    def trace(self):
        """`with prof.trace():` traces its body; the trace is stopped and written even if
        the body raises (the body's error is the one that propagates)."""
        self.start()
        try:
            yield self
        except BaseException:
            if self.running:
                with contextlib.suppress(RuntimeError):  # the body's error, not the stop's
                    self.stop()
            raise
        if self.running:
            self.stop()

    def step(self, i: int):
        """A context manager marking training step `i` on the timeline (a "train" event
        with step_num=i, which TensorBoard's step-time view groups by)."""
        if not self.enabled:
            return _NOTHING
        return jax.profiler.StepTraceAnnotation(STEP_NAME, step_num=i)


_NOTHING = contextlib.nullcontext()


def _made(directory: Path) -> Path:
    """`directory`, absolute, created if missing; a ValueError naming it if it cannot be."""
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"profile directory {directory} exists and is not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"profile directory {directory} cannot be created: {e}") from e
    return directory.resolve()


# --- reading a trace back


@dataclass(frozen=True)
class OpTime:
    """One op's self time summed over the trace: its events, on all devices and steps."""

    name: str
    total_ms: float
    count: int  # how many times it ran (per device, per step, per loop iteration)
    share: float  # of all ops' summed self time


def top_ops(directory: str | Path, n: int = 5) -> list[OpTime] | None:
    """The `n` ops with the most self time in the newest trace under `directory` (a
    Profiler's DIR, one trace folder, or an .xplane.pb); None if there is no readable
    trace, [] if it holds no op events."""
    data = _read(directory)
    if data is None:
        return None
    total_ns, count = defaultdict(float), defaultdict(int)
    for line in _op_lines(data):
        for name, ns in _self_times(line):
            total_ns[name] += ns
            count[name] += 1
    whole = sum(total_ns.values()) or 1.0
    ranked = sorted(total_ns, key=total_ns.get, reverse=True)[:n]
    return [OpTime(name, total_ns[name] / 1e6, count[name], total_ns[name] / whole)
            for name in ranked]


def step_times(directory: str | Path) -> list[float] | None:
    """Durations (ms) of the "train" step events of the newest trace under `directory`, in
    the order they ran (to set beside the caller's own timer); None if none is readable."""
    data = _read(directory)
    if data is None:
        return None
    steps = [e for plane in data.planes if plane.name == "/host:CPU" for line in plane.lines
             for e in line.events if e.name == STEP_NAME and "step_num" in dict(e.stats)]
    return [e.duration_ns / 1e6 for e in sorted(steps, key=lambda e: e.start_ns)]


def _newest(directory: str | Path) -> Path | None:
    """The newest .xplane.pb under `directory` (or `directory` itself if it is a file)."""
    path = Path(directory)
    if path.is_file():
        return path
    found = list(path.rglob("*.xplane.pb"))  # nothing if it is not a directory
    return max(found, key=lambda p: p.stat().st_mtime_ns) if found else None


def _read(directory: str | Path):
    """The newest trace as a jax.profiler.ProfileData, or None."""
    path = _newest(directory)
    try:
        return jax.profiler.ProfileData.from_file(str(path)) if path else None
    except Exception:  # a truncated or foreign file: nothing to read back
        return None


def _op_lines(data) -> list[list[tuple[str, float, float]]]:
    """Each line's op events as (op name, start ns, end ns): the device planes' ops if
    there are any (GPU, TPU), else the host's XLA ops (CPU)."""
    lines = [line for plane in data.planes if plane.name.startswith("/device:")
             for line in _ops_of(plane, "XLA Ops")]
    if not any(lines):
        lines = [line for plane in data.planes if plane.name == "/host:CPU"
                 for line in _ops_of(plane, None)]
    return lines


def _ops_of(plane, op_line: str | None) -> list[list[tuple[str, float, float]]]:
    """A plane's op events: its `op_line` (events named by op) if it has one, else, on
    every line (threads on CPU, streams on GPU), the events an op stamped with hlo_op."""
    named = [line for line in plane.lines if line.name == op_line]
    if named:
        return [[(e.name, e.start_ns, e.end_ns) for e in line.events] for line in named]
    return [[(op, e.start_ns, e.end_ns) for e in line.events
             if (op := dict(e.stats).get("hlo_op"))] for line in plane.lines]


def _self_times(events: list[tuple[str, float, float]]) -> list[tuple[str, float]]:
    """(name, self ns) of each op of one line: its duration less that of the ops nested in
    it. Events of one thread or stream nest; an open stack finds each one's parent."""
    done, stack = [], []  # stack entries: [name, end, self ns]
    for name, start, end in sorted(events, key=lambda e: (e[1], -e[2])):
        while stack and stack[-1][1] <= start:
            done.append(stack.pop())
        if stack:
            stack[-1][2] -= min(end, stack[-1][1]) - start
        stack.append([name, end, end - start])
    return [(name, ns) for name, _, ns in done + stack]
