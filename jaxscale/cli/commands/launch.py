"""`jaxscale launch`: P local processes that together form one jax.distributed job.

    jaxscale launch --processes 2 --devices-per-process 4 -- train --mesh dp=8 --steps 50

The launcher is a supervisor, never a participant (it never starts JAX). In order:

  checks    before any child starts, each bad input is one line and exit 2: the command
            (train or compare), --devices and train's --mesh against P x K, the options the
            launcher sets itself, the port, a launch inside a launch; then the command's own
            parser reads ARGS, so a typo is reported once instead of by P processes;
  then      `runtime.launcher` starts the children (`python -m jaxscale COMMAND ARGS
            --coordinator 127.0.0.1:PORT --num-processes P --process-id i --devices P*K
            ...`, the launcher's values last, so they win), copies their output to
            DIR/process-<i>.log, ends the job at the first death, and passes Ctrl-C on;
            its docstring says how. (A launcher killed by SIGKILL can pass nothing on: its
            children stop when their next write finds the pipe gone, or when JAX's
            heartbeat times out.)
"""
from __future__ import annotations

import argparse
import os
import sys

from jaxscale.cli.main import COMMANDS, _number
from jaxscale.runtime.launcher import LaunchError, child_argv, child_env, coordinator_port, launch
from jaxscale.runtime.devices import MAX_CPU_DEVICES
from jaxscale.runtime.mesh import parse_mesh_spec
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

EXAMPLE = """example:
  jaxscale launch --processes 2 --devices-per-process 4 -- train --mesh dp=4,tp=2 --steps 50

Process 0's output appears here as it comes; every process's output is in
DIR/process-<i>.log. When one process dies, the launcher stops the others at once and exits
with the dead process's code; Ctrl-C is passed to every process."""


def register(subparsers) -> None:
    """Add the `launch` subcommand to jaxscale's parser."""
    p = subparsers.add_parser(
        "launch", help=COMMANDS["launch"],
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
    if command == "compare" and "--abstract" in args:  # refused by every process otherwise
        raise LaunchError("compare --abstract compiles in one process and runs nothing: run "
                          "`jaxscale compare --abstract` without launch")
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
