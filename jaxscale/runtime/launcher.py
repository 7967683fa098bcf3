"""The local launcher's engine: start P processes of one job, copy their output, watch them,
and end them all together (see `jaxscale launch`, whose command lives in cli/commands).

  children  child i is the ordinary CLI with its place in the job appended (`child_argv`),
            with JAXSCALE_LAUNCHED=1, unbuffered output and XLA_FLAGS less a forced host
            device count (`child_env`: jaxscale forces the devices itself). Each
            child leads its own process group: a terminal's Ctrl-C reaches the launcher
            alone (which passes it on once), and a signal to the group also reaches what the
            child started (compare's worker);
  output    a thread per stream copies each line to DIR/process-<i>.log, and process 0's
            also to our stdout / stderr, without gloo's "[Gloo]" connection chatter;
  watching  the main thread polls the children. The first one to exit non-zero or by a
            signal ends the job at once, not after JAX's heartbeat timeout: the others get
            SIGTERM, then SIGKILL after TERMINATE_GRACE_S; then, as the last output, one
            line names the lost process and its last log lines follow. The exit code is
            that child's (128 + the signal's number for a signal); 0 when all exit 0;
  signals   SIGINT (also SIGTERM, SIGHUP) is passed to every child's group; what still runs
            after INTERRUPT_GRACE_S (or at a second Ctrl-C) is killed; exit 128 + signal,
            130 for Ctrl-C. Every child is reaped before the launcher returns.

Plain processes and sockets: the launcher never starts JAX.
"""
from __future__ import annotations

import collections
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from jaxscale.report import plural
from jaxscale.runtime.processes import LAUNCHED_ENV


# After a child died: SIGTERM, then SIGKILL. A JAX process of a multi-process job survives
# SIGTERM (JAX's preemption notifier catches it), so it is the SIGKILL that ends it.
TERMINATE_GRACE_S = 3.0
INTERRUPT_GRACE_S = 5.0  # after Ctrl-C: time to save partial results, then SIGKILL
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
POLL_S = 0.05
TAIL_LINES = 10


class LaunchError(ValueError):
    """A launch request that cannot run (bad command, mismatched devices, busy port)."""


def child_argv(command, args, i, processes, devices_per_process, port, heartbeat_s,
               shutdown_s) -> list[str]:
    """Process i's command line: the ordinary CLI with its place in the job appended."""
    return [sys.executable, "-m", "jaxscale", command, *args,
            "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes),
            "--process-id", str(i), "--devices", str(processes * devices_per_process),
            "--heartbeat-timeout", str(heartbeat_s), "--shutdown-timeout", str(shutdown_s)]


DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def without_device_count(environ) -> dict[str, str]:
    """`environ` with XLA_FLAGS' forced host device count taken out (a process of jaxscale
    forces its devices itself, with jax_num_cpu_devices, which the flag would contradict);
    the other XLA flags (an optimization level, a dump folder) are kept."""
    env = dict(environ)
    flags = [f for f in env.pop("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
    return env | ({"XLA_FLAGS": " ".join(flags)} if flags else {})


def child_env(environ=None) -> dict[str, str]:
    """Our environment (`without_device_count`), marked launched, and with unbuffered
    output so process 0's lines appear as they are printed."""
    env = without_device_count(os.environ if environ is None else environ)
    return {**env, LAUNCHED_ENV: "1", "PYTHONUNBUFFERED": "1"}


def coordinator_port(port: int | None = None) -> int:
    """`port` if no one listens on it, a free port if None; LaunchError if it is taken."""
    try:  # JAX's coordinator binds [::]:PORT, all addresses: probe the same way
        dual = socket.has_dualstack_ipv6()
        with socket.create_server(("", port or 0), family=socket.AF_INET6 if dual else
                                  socket.AF_INET, dualstack_ipv6=dual) as s:
            return s.getsockname()[1]
    except OSError as e:
        if port is None:
            raise LaunchError(f"found no free port for the coordinator ({e.strerror})") from None
        raise LaunchError(f"--port {port} cannot be used for the coordinator ({e.strerror}); "
                          "choose another, or leave --port out to take a free one") from None


def shown(line: bytes) -> bool:
    """Whether a child's output line is for the user (gloo's connection chatter is not)."""
    return not line.startswith(b"[Gloo]")


class _Child:
    """One started process: its log file, the tail of its output, its reader threads."""

    def __init__(self, i: int, argv: list[str], logs: Path, env, out, err):
        self.i, self.log_path = i, logs / f"process-{i}.log"
        self.log, self.lock = open(self.log_path, "wb", buffering=0), threading.Lock()
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE if i == 0 else subprocess.STDOUT,
                                     env=env, start_new_session=True)
        streams = [(self.proc.stdout, out if i == 0 else None)]
        if i == 0:
            streams.append((self.proc.stderr, err))
        self.readers = [threading.Thread(target=self._copy, args=s, daemon=True)
                        for s in streams]
        for t in self.readers:
            t.start()

    def _copy(self, stream, echo) -> None:
        for line in stream:
            with self.lock:
                if self.log.closed:  # the launcher is done
                    return
                self.log.write(line)
            if not shown(line):
                continue
            text = line.decode(errors="replace")
            self.tail.append(text.rstrip())
            try:
                if echo is not None:
                    echo.write(text)
                    echo.flush()
            except (OSError, ValueError):  # our output is gone (`| head`): keep logging
                echo = None

    def signal(self, sig: int) -> None:
        """`sig` to the child's process group: the child and whatever it started."""
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):  # the whole group is gone
            pass

    def finish(self, timeout: float = 2.0) -> None:
        """Wait for the reader threads to copy the last lines."""
        for t in self.readers:
            t.join(timeout)


def launch(argvs: list[list[str]], logs, env=None, out=None, err=None) -> int:
    """Run one process per argv and watch them; the exit code (see the module docstring)."""
    out, err = out or sys.stdout, err or sys.stderr
    logs = Path(logs)
    logs.mkdir(parents=True, exist_ok=True)
    for old in logs.glob("process-*.log"):  # an earlier launch's, of more processes
        m = re.fullmatch(r"process-(\d+)\.log", old.name)
        if m and int(m.group(1)) >= len(argvs):
            old.unlink()
    received: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _: received.append(signum))
                for s in STOP_SIGNALS}
    children: list[_Child] = []
    try:
        for i, argv in enumerate(argvs):
            if received:
                break
            try:
                children.append(_Child(i, argv, logs, env, out, err))
            except OSError as e:
                raise LaunchError(f"cannot start process {i} ({argv[0]}): {e}") from None
        while not received:
            codes = [c.proc.poll() for c in children]
            lost = next((c for c, rc in zip(children, codes) if rc not in (None, 0)), None)
            if lost is not None:
                return _lost(children, lost, received, err)
            if all(rc == 0 for rc in codes):
                return 0
            time.sleep(POLL_S)
        return _interrupted(children, received, err, logs)
    finally:
        _end(children, signal.SIGKILL, 0, lambda: True)  # what they started, if anything
        for c in children:
            c.finish()
            with c.lock:
                c.log.close()
        for s, handler in previous.items():
            signal.signal(s, handler)


def _end(children, sig: int, grace: float, hurry) -> list[_Child]:
    """`sig` to every child's group, SIGKILL after `grace` s (or once hurry()); those killed."""
    for c in children:
        c.signal(sig)
    deadline = time.monotonic() + grace
    while (any(c.proc.poll() is None for c in children) and time.monotonic() < deadline
           and not hurry()):
        time.sleep(POLL_S)
    left = [c for c in children if c.proc.poll() is None]
    for c in children:
        c.signal(signal.SIGKILL)
        c.proc.kill()  # also a child that left its group
        c.proc.wait()
    return left


def _lost(children, lost: _Child, received, err) -> int:
    """The first child died: stop the others, then name it and show its last lines."""
    rc = lost.proc.returncode
    running = sum(c.proc.poll() is None for c in children)
    _end(children, signal.SIGTERM, TERMINATE_GRACE_S, lambda: bool(received))
    for c in (children[0], lost):  # the last of process 0's output before our report
        c.finish()
    stopped = {0: "no other was running", 1: "stopped the other process"}.get(
        running, f"stopped the other {running} processes")
    lines = "".join(f"    {line}\n" for line in lost.tail) or "    (no output)\n"
    err.write(f"jaxscale launch: process {lost.i} (pid {lost.proc.pid}) died: "
              f"{exit_text(rc)}; {stopped}; its last lines ({lost.log_path}):\n{lines}")
    err.flush()
    return 128 - rc if rc < 0 else rc


def _interrupted(children, received, err, logs) -> int:
    """Pass the signal to every child, wait a bounded time, then kill what is left."""
    sig = signal.Signals(received[0])
    running = sum(c.proc.poll() is None for c in children)
    err.write(f"jaxscale launch: {sig.name}: passed to {plural(running, 'process')}; waiting "
              f"up to {INTERRUPT_GRACE_S:g} s for them to stop (Ctrl-C again: kill now)\n")
    err.flush()
    left = _end(children, sig, INTERRUPT_GRACE_S, lambda: len(received) > 1)
    for c in children:
        c.finish()
    killed = (f"; killed process {', '.join(str(c.i) for c in left)}, still running after "
              f"{INTERRUPT_GRACE_S:g} s" if left else "")
    err.write(f"jaxscale launch: interrupted{killed}; logs in {logs}/\n")
    err.flush()
    return 128 + sig


def exit_text(rc: int) -> str:
    """How a child ended: 'exit code N' or 'signal NAME'."""
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"exit code {rc}"
