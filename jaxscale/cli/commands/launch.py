"""`jaxscale launch`: P local processes that together form one jax.distributed job.

    jaxscale launch --processes 2 --devices-per-process 4 -- train --mesh dp=8 --steps 50

The launcher is a supervisor, never a participant (it never starts JAX). In order:

  checks    before any child starts, each bad input is one line and exit 2: the command
            (train or compare), --devices and train's --mesh against P x K, the options the
            launcher sets itself, the port, a launch inside a launch; then the command's own
            parser reads ARGS, so a typo is reported once instead of by P processes;
  children  child i is the ordinary CLI, `python -m jaxscale COMMAND ARGS --coordinator
            127.0.0.1:PORT --num-processes P --process-id i --devices P*K --heartbeat-timeout
            S1 --shutdown-timeout S2` (the launcher's values last, so they win), with
            JAXSCALE_LAUNCHED=1, unbuffered output and no XLA_FLAGS. Each child leads its
            own process group: a terminal's Ctrl-C reaches the launcher alone (which passes
            it on once), and a signal to the group also reaches what the child started
            (compare's worker);
  output    a thread per stream copies each line to DIR/process-<i>.log, and process 0's
            also to our stdout / stderr, without gloo's "[Gloo]" connection chatter;
  watching  the main thread polls the children. The first one to exit non-zero or by a
            signal ends the job at once, not after JAX's heartbeat timeout: the others get
            SIGTERM, then SIGKILL after TERMINATE_GRACE_S; then, as the last output, one
            line names the lost process and its last log lines follow. The exit code is
            that child's (128 + the signal's number for a signal); 0 when all exit 0;
  signals   SIGINT (also SIGTERM, SIGHUP) is passed to every child's group; what still runs
            after INTERRUPT_GRACE_S (or at a second Ctrl-C) is killed; exit 128 + signal,
            130 for Ctrl-C. Every child is reaped before the launcher returns. (A launcher
            killed by SIGKILL can pass nothing on: its children stop when their next write
            finds the pipe gone, or when JAX's heartbeat times out.)
"""
from __future__ import annotations

import argparse
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

from jaxscale.cli.main import UsageError, _number
from jaxscale.compare.run import _exit_text
from jaxscale.runtime.devices import MAX_CPU_DEVICES, parse_mesh_spec
from jaxscale.cli.paths import output_dir
from jaxscale.report import plural

LAUNCHABLE = ("train", "compare")
# Set by the launcher for each process; ARGS must not contain them.
PLACEMENT = ("--coordinator", "--num-processes", "--process-id")
TIMEOUTS = ("--heartbeat-timeout", "--shutdown-timeout")
# Each process is a Python + JAX runtime (hundreds of MB, 1-2 s to start): 64 is far past
# what one host can run usefully, and beyond it the coordinator's start-up alone is slow.
MAX_PROCESSES = 64
MAX_TIMEOUT_S = 3600
# After a child died: SIGTERM, then SIGKILL. A JAX process of a multi-process job survives
# SIGTERM (JAX's preemption notifier catches it), so it is the SIGKILL that ends it.
TERMINATE_GRACE_S = 3.0
INTERRUPT_GRACE_S = 5.0  # after Ctrl-C: time to save partial results, then SIGKILL
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
POLL_S = 0.05
TAIL_LINES = 10

EXAMPLE = """example:
  jaxscale launch --processes 2 --devices-per-process 4 -- train --mesh dp=4,tp=2 --steps 50

Process 0's output appears here as it comes; every process's output is in
DIR/process-<i>.log. When one process dies, the launcher stops the others at once and exits
with the dead process's code; Ctrl-C is passed to every process."""


class LaunchError(UsageError):
    """A launch request that cannot run (bad command, mismatched devices, busy port)."""


def register(subparsers) -> None:
    """Add the `launch` subcommand to jaxscale's parser."""
    p = subparsers.add_parser(
        "launch", help="run train or compare as one job of several local processes",
        usage="jaxscale launch --processes P --devices-per-process K [options] -- "
              f"{{{','.join(LAUNCHABLE)}}} ARGS",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLE, description=(
            "Start P processes on this host that form one jax.distributed job: each one\n"
            "splits the CPU into K devices, and collectives between processes go over gloo.\n"
            "The multi-process runtime of a cluster, on one machine."))
    p.add_argument("--processes", type=_number(maximum=MAX_PROCESSES), required=True,
                   metavar="P", help=f"processes to start (at most {MAX_PROCESSES})")
    p.add_argument("--devices-per-process", type=_number(maximum=MAX_CPU_DEVICES),
                   required=True, metavar="K",
                   help=f"CPU devices each process forces; P x K at most {MAX_CPU_DEVICES}")
    p.add_argument("--port", type=_number(maximum=65535), default=None, metavar="N",
                   help="the coordinator's port on 127.0.0.1 (default: a free one)")
    p.add_argument("--heartbeat-timeout", type=_number(maximum=MAX_TIMEOUT_S), default=10,
                   metavar="S", help="seconds a process waits for a silent peer (frozen, or "
                                     "dead where no launcher sees it) before it aborts "
                                     "(default 10)")
    p.add_argument("--shutdown-timeout", type=_number(maximum=MAX_TIMEOUT_S), default=30,
                   metavar="S", help="seconds a process waits at exit for the others to "
                                     "finish too before it aborts (default 30)")
    p.add_argument("--logs", type=output_dir, default="runs/launch", metavar="DIR",
                   help="folder for process-<i>.log, one per process (default runs/launch)")
    p.add_argument("child", nargs=argparse.REMAINDER, metavar="-- COMMAND ARGS",
                   help=f"the command to run in every process ({' or '.join(LAUNCHABLE)}) "
                        "and its options")
    p.set_defaults(run=run)


def run(args) -> int:
    from jaxscale.cli.main import build_parser

    processes, per = args.processes, args.devices_per_process
    command, child_args = check_request(args.child, processes, per)
    build_parser().parse_args([command, *child_args])  # a bad option: one line, exit 2
    port = coordinator_port(args.port)
    argvs = [child_argv(command, child_args, i, processes, per, port, args.heartbeat_timeout,
                        args.shutdown_timeout) for i in range(processes)]
    print(f"jaxscale launch: {plural(processes, 'process')} x {plural(per, 'CPU device')}, "
          f"coordinator 127.0.0.1:{port}, logs in {args.logs}/", file=sys.stderr, flush=True)
    return launch(argvs, args.logs, env=child_env())


def check_request(words, processes: int, devices_per_process: int, environ=None):
    """(command, args) from the words after `--`; LaunchError if they cannot be launched."""
    if (os.environ if environ is None else environ).get("JAXSCALE_LAUNCHED"):
        raise LaunchError("jaxscale launch cannot run inside a launched process "
                          "(JAXSCALE_LAUNCHED is set); run it from a plain shell")
    total = processes * devices_per_process
    if total > MAX_CPU_DEVICES:
        raise LaunchError(f"{processes} processes x {devices_per_process} devices = {total} "
                          f"CPU devices, more than the {MAX_CPU_DEVICES} this host can run")
    words = list(words)[1:] if list(words)[:1] == ["--"] else list(words)
    if not words:
        raise LaunchError(f"name the command to launch after --, one of {', '.join(LAUNCHABLE)}"
                          ": jaxscale launch --processes 2 --devices-per-process 4 -- train")
    command, args = words[0], words[1:]
    if command not in LAUNCHABLE:
        raise LaunchError(f"cannot launch {command!r}: the command after -- must be one of "
                          f"{', '.join(LAUNCHABLE)}")
    for option in PLACEMENT + TIMEOUTS:
        if _values(args, option):
            how = ("the launcher sets it for each process" if option in PLACEMENT
                   else "give it to launch, before --; it is passed to every process")
            raise LaunchError(f"{command} {option}: leave it out, {how}")
    # Abbreviations (`--dev 4`) are not looked for: the launcher's values come last and win.
    # A missing or unreadable value is left to the command's own parser to report.
    for text in _values(args, "--devices"):
        if _float(text) not in (None, total):
            raise LaunchError(f"--devices {text} does not match {processes} processes x "
                              f"{devices_per_process} devices = {total}; leave --devices out "
                              f"(the launcher passes --devices {total})")
    for spec in _values(args, "--mesh") if command == "train" else []:
        size = parse_mesh_spec(spec).size if spec is not None else total
        if size != total:
            raise LaunchError(f"processes x devices-per-process = {total} devices but mesh "
                              f"{spec} has {size}; make the mesh sizes multiply to {total}")
    return command, args


def _values(args: list[str], option: str) -> list[str | None]:
    """Each value `option` is given in args, as `option V` or `option=V` (None: no value)."""
    found = []
    for i, word in enumerate(args):
        if word == option:
            found.append(args[i + 1] if i + 1 < len(args) else None)
        elif word.startswith(option + "="):
            found.append(word[len(option) + 1:])
    return found


def _float(text: str | None) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def child_argv(command, args, i, processes, devices_per_process, port, heartbeat_s,
               shutdown_s) -> list[str]:
    """Process i's command line: the ordinary CLI with its place in the job appended."""
    return [sys.executable, "-m", "jaxscale", command, *args,
            "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes),
            "--process-id", str(i), "--devices", str(processes * devices_per_process),
            "--heartbeat-timeout", str(heartbeat_s), "--shutdown-timeout", str(shutdown_s)]


def child_env(environ=None) -> dict[str, str]:
    """Our environment, without XLA_FLAGS (jaxscale forces devices itself), marked launched,
    and with unbuffered output so process 0's lines appear as they are printed."""
    env = {k: v for k, v in (os.environ if environ is None else environ).items()
           if k != "XLA_FLAGS"}
    return {**env, "JAXSCALE_LAUNCHED": "1", "PYTHONUNBUFFERED": "1"}


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
              f"{_exit_text(rc)}; {stopped}; its last lines ({lost.log_path}):\n{lines}")
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
