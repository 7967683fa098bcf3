"""Restart a training run that died, from its latest checkpoint: `train --max-restarts R`.

The supervisor never starts JAX. It runs the same `jaxscale train` command line as a child
process (with JAXSCALE_SUPERVISED=1, so the child trains instead of supervising again) and
waits. A child that dies (a signal such as SIGKILL, an abort, any exit code but 0, 2 (bad
input) and 130 (Ctrl-C)) is started again, at most R times, with --resume when the
checkpoint directory holds a complete step by then, so it continues from the latest one;
faults injected with --inject fire once per run, so the restarted run does not crash at the
same step again (jaxscale.training.faults.FaultLog). Ctrl-C goes to the child alone, once; nothing
is restarted after it. Each attempt's start, end and exit code are kept for the failure
experiment (experiments/failures.py), which measures the time a restart costs from them.

The job's wall time is every child's and every restart's (first start to last end), not the
last child's alone: after a restart it is said on stderr, and with --json the last child's
JSON object gains "job_wall_s" and "last_child_wall_s" (and "restarts").
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from jaxscale.runtime.processes import SUPERVISED_ENV
from jaxscale.training.checkpoint.store import complete_steps

NO_RESTART = (0, 2, 130)  # finished, refused its input, interrupted: a restart would not help


@dataclass
class Attempt:
    start: float  # time.time() when the child started, and when it ended
    end: float
    returncode: int  # the child's exit code; -N for signal N
    resumed: bool  # started with --resume


@dataclass
class Supervised:
    returncode: int
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def restarts(self) -> int:
        return len(self.attempts) - 1

    @property
    def wall_s(self) -> float:
        """The whole job: the first child's start to the last one's end, restarts included."""
        return self.attempts[-1].end - self.attempts[0].start if self.attempts else 0.0

    @property
    def last_wall_s(self) -> float:
        """The last child's own wall time (what its table and JSON measured)."""
        return self.attempts[-1].end - self.attempts[-1].start if self.attempts else 0.0

    def note_json(self, text: str) -> str:
        """The last child's stdout with the job's wall time added to its JSON object (the
        text unchanged if it is not one)."""
        try:
            obj = json.loads(text)
        except ValueError:
            return text
        if not isinstance(obj, dict):
            return text
        obj.update(job_wall_s=self.wall_s, last_child_wall_s=self.last_wall_s,
                   restarts=self.restarts)
        return json.dumps(obj) + "\n"


def describe(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def supervise(argv: list[str], checkpoint_dir: str, max_restarts: int, resume: bool = False,
              log=None, program: list[str] | None = None,
              as_json: bool | None = None) -> Supervised:
    """Run `python -m jaxscale ARGV` (or `program` ARGV) until it ends well, restarting it at
    most `max_restarts` times (see the module docstring). `resume`: ARGV already resumes."""

    log = log or (lambda msg: print(f"jaxscale: note: {msg}", file=sys.stderr))
    program = program or [sys.executable, "-m", "jaxscale"]
    if as_json is None:  # the child's JSON is read, to add the job's wall time
        as_json = "--json" in argv
    env = {**os.environ, SUPERVISED_ENV: "1"}
    out = Supervised(0)
    interrupted, child = False, None

    def on_interrupt(signum, frame):
        nonlocal interrupted
        interrupted = True
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGINT)

    previous = signal.signal(signal.SIGINT, on_interrupt)
    try:
        while True:
            again = bool(out.attempts) and bool(complete_steps(checkpoint_dir))
            args = [*program, *argv] + (["--resume"] if again and not resume else [])
            if interrupted:  # a Ctrl-C between two runs: no next run
                out.returncode = 130
                return out
            t0 = time.time()
            child = subprocess.Popen(args, env=env, start_new_session=True, text=True,
                                     stdout=subprocess.PIPE if as_json else None)
            if interrupted:  # it came while the child started: pass it on
                child.send_signal(signal.SIGINT)
            text = child.communicate()[0] or ""
            rc = child.returncode
            out.attempts.append(Attempt(t0, time.time(), rc, again or resume))
            out.returncode = 130 if interrupted else rc
            if interrupted or rc in NO_RESTART or out.restarts >= max_restarts:
                if rc not in NO_RESTART and not interrupted:
                    log(f"training {describe(rc)}; no restarts left (--max-restarts "
                        f"{max_restarts})")
                _finish(out, text, as_json, log)
                return out
            sys.stdout.write(text)  # a failed child's output, as it printed it
            steps = complete_steps(checkpoint_dir)
            log(f"training {describe(rc)} after {time.time() - t0:.1f} s; restart "
                f"{out.restarts + 1} of {max_restarts} "
                + (f"from the checkpoint of step {steps[-1]}" if steps else
                   "from the beginning (no checkpoint was complete)"))
    finally:
        signal.signal(signal.SIGINT, previous)


def _finish(out: Supervised, text: str, as_json: bool, log) -> None:
    """The last child's output (its JSON with the job's wall time), and after a restart the
    job's wall time on stderr: the child's own figures cover the last child alone."""
    if as_json:
        sys.stdout.write(out.note_json(text))
        sys.stdout.flush()
    elif out.restarts:
        log(f"job wall time {out.wall_s:.1f} s over {len(out.attempts)} runs, restarts "
            f"included (the last run alone: {out.last_wall_s:.1f} s)")
