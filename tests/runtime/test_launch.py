"""`jaxscale launch`: each bad request is one line and exit 2 before anything starts; the
supervisor streams process 0, logs every process, stops the job when one process dies or
on Ctrl-C, and leaves no process behind (fake children, no JAX)."""
import io
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from jaxscale.cli import main as cli
from jaxscale.cli.commands import launch as L
from jaxscale.runtime import launcher

ROOT = Path(__file__).resolve().parents[2]

# A stand-in for `python -m jaxscale train ...`: argv is INDEX ROLE PROCESSES FOLDER, the
# role words saying what it does (ok: exit 0; fail: exit 3; kill: SIGKILL itself; otherwise
# sleep; parent: start a grandchild first; deaf: ignore SIGINT and SIGTERM). Every child
# writes its pid (and its grandchild's) to FOLDER and waits until all are up, so that a test
# knows every pid it must find dead afterwards; then "ready-<i>" once it has printed.
FAKE = textwrap.dedent('''
    import os, signal, subprocess, sys, time
    i, role, n, folder = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
    def note(name, text):
        with open(os.path.join(folder, name + ".tmp"), "w") as f:
            f.write(text)
        os.replace(os.path.join(folder, name + ".tmp"), os.path.join(folder, name))
    if "deaf" in role:  # ignores Ctrl-C and SIGTERM: only SIGKILL ends it
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if "parent" in role:  # starts a process of its own, in its process group
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        note(f"grandchild-{i}", str(child.pid))
    note(f"pid-{i}", str(os.getpid()))
    deadline = time.time() + 20
    while (sum(f.startswith("pid-") and not f.endswith(".tmp") for f in os.listdir(folder)) < n
           and time.time() < deadline):
        time.sleep(0.02)
    try:
        print(f"out {i}")
        print(f"[Gloo] Rank {i} is connected to 1 peer ranks", file=sys.stderr)
        print(f"err {i}", file=sys.stderr)
        note(f"ready-{i}", "")
        if "fail" in role:
            for k in range(15):
                print(f"line {k}")
            sys.exit(3)
        if "kill" in role:
            os.kill(os.getpid(), signal.SIGKILL)
        if "ok" not in role:
            time.sleep(60)
    except KeyboardInterrupt:
        print(f"process {i} got SIGINT", flush=True)
        sys.exit(130)
''')


def fake_argvs(folder: Path, *roles: str) -> list[list[str]]:
    return [[sys.executable, "-c", FAKE, str(i), role, str(len(roles)), str(folder)]
            for i, role in enumerate(roles)]


def alive(pid: int) -> bool:
    """Whether pid runs (a zombie waiting for its parent does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def pids(folder: Path) -> list[int]:
    return [int(p.read_text()) for pattern in ("pid-*", "grandchild-*")
            for p in sorted(folder.glob(pattern)) if p.suffix != ".tmp"]


def assert_all_gone(folder: Path, expected: int) -> None:
    found = pids(folder)
    assert len(found) == expected, found
    deadline = time.monotonic() + 5  # a killed grandchild is reaped by init, not by us
    while any(alive(p) for p in found) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in found if alive(p)], "orphans left"


@pytest.fixture
def bounded(tmp_path):
    """A folder for the children's pids; the test is ended after 30 s (SIGALRM breaks out of
    the launcher's loop, whose finally kills the children) and any survivor is killed."""
    def too_long(*_):
        raise TimeoutError("launch test ran past 30 s")
    previous = signal.signal(signal.SIGALRM, too_long)
    signal.alarm(30)
    try:
        yield tmp_path
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        for pid in pids(tmp_path):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def main(monkeypatch):
    """cli.main with launch() replaced by a recorder, so that a test sees whether anything
    would start."""
    started = []
    monkeypatch.setattr(L, "launch", lambda argvs, logs, env=None: started.append(argvs) or 0)
    return lambda *argv: (cli.main(list(argv)), started)


def usage_error(main, capsys, *argv) -> str:
    """Run `jaxscale launch ARGV`, expect exit 2 and nothing started; the error line."""
    with pytest.raises(SystemExit) as e:
        main("launch", *argv)
    err = capsys.readouterr().err
    assert e.value.code == cli.EXIT_USAGE, err
    assert err.count("\n") == 1 and err.startswith("jaxscale: error: "), err
    return err


LAUNCH = ("--processes", "2", "--devices-per-process", "4")


# --- the checks, without starting anything ---------------------------------------------------

@pytest.mark.parametrize("words, message", [
    ([], "name the command to launch after --, one of train, compare"),
    (["--"], "name the command to launch after --"),
    (["--", "memory", "--params", "7e9"], "cannot launch 'memory': the command after -- must "
                                          "be one of train, compare"),
    (["--", "train", "--devices", "4"], "--devices 4 does not match 2 processes x 4 devices "
                                        "= 8; leave --devices out"),
    (["--", "compare", "--devices=16"], "--devices 16 does not match"),
    (["--", "train", "--mesh", "dp=2,tp=1"], "processes x devices-per-process = 8 devices but "
                                             "mesh dp=2,tp=1 has 2"),
    (["--", "train", "--mesh=pp=4"], "but mesh pp=4 has 4"),
    (["--", "train", "--coordinator", "10.0.0.1:99"], "train --coordinator: leave it out, the "
                                                      "launcher sets it"),
    (["--", "compare", "--num-processes=3"], "compare --num-processes: leave it out"),
    (["--", "train", "--process-id", "1"], "train --process-id: leave it out"),
    (["--", "train", "--heartbeat-timeout", "5"], "give it to launch, before --"),
    (["--", "train", "--shutdown-timeout=5"], "give it to launch, before --"),
])
def test_a_request_that_cannot_run_is_refused(words, message, main, capsys):
    with pytest.raises(launcher.LaunchError, match=None) as e:
        L.check_request(words, 2, 4, environ={})
    assert message in str(e.value)
    assert message in usage_error(main, capsys, *LAUNCH, *words)


def test_a_request_that_fits_is_accepted():
    words = ["--", "train", "--devices", "8", "--mesh", "dp=4,tp=2", "--steps", "3"]
    assert L.check_request(words, 2, 4, environ={}) == ("train", words[2:])
    assert L.check_request(["compare", "--devices=8.0"], 2, 4, environ={})[0] == "compare"
    # compare has no --mesh; its own parser, not the launcher, answers for it
    assert L.check_request(["compare", "--mesh", "dp=2"], 2, 4, environ={})[0] == "compare"


def test_launch_inside_launch_is_refused(main, capsys, monkeypatch):
    with pytest.raises(launcher.LaunchError, match="JAXSCALE_LAUNCHED is set"):
        L.check_request(["train"], 2, 4, environ={"JAXSCALE_LAUNCHED": "1"})
    monkeypatch.setenv("JAXSCALE_LAUNCHED", "1")
    assert "cannot run inside a launched process" in usage_error(main, capsys, *LAUNCH,
                                                                 "--", "train")


@pytest.mark.parametrize("argv, message", [
    (["--processes", "0", "--devices-per-process", "4"], "--processes: must be an integer >= 1"),
    (["--processes", "2", "--devices-per-process", "1.5"], "must be an integer >= 1, got '1.5'"),
    (["--processes", "65", "--devices-per-process", "1"], "must be at most 64, got 65"),
    (["--processes", "2", "--devices-per-process", "513"], "must be at most 512, got 513"),
    (["--processes", "4", "--devices-per-process", "256"], "4 processes x 256 devices = 1024 "
                                                           "CPU devices, more than the 512"),
    (["--devices-per-process", "4"], "the following arguments are required: --processes"),
    ([*LAUNCH, "--port", "70000"], "must be at most 65535"),
    ([*LAUNCH, "--heartbeat-timeout", "0"], "--heartbeat-timeout: must be an integer >= 1"),
    ([*LAUNCH, "--", "train", "--stpes", "3"], "unrecognized arguments: --stpes 3"),
])
def test_bad_launcher_options_are_one_line(argv, message, main, capsys):
    words = [] if "--" in argv else ["--", "train"]
    assert message in usage_error(main, capsys, *argv, *words)


def test_a_port_in_use_is_refused_and_a_free_one_is_found(main, capsys):
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        with pytest.raises(launcher.LaunchError, match=f"--port {port} cannot be used"):
            launcher.coordinator_port(port)
        assert f"--port {port} cannot be used" in usage_error(
            main, capsys, *LAUNCH, "--port", str(port), "--", "train")
    free = launcher.coordinator_port()
    assert 1 <= free <= 65535 and launcher.coordinator_port(free) == free


def test_each_child_runs_the_cli_with_its_place_in_the_job(main, capsys, tmp_path):
    code, started = main("launch", *LAUNCH, "--port", str(launcher.coordinator_port()),
                         "--heartbeat-timeout", "7", "--logs", str(tmp_path / "logs"),
                         "--", "train", "--steps", "3")
    assert code == 0 and len(started) == 1
    argvs = started[0]
    port = argvs[0][argvs[0].index("--coordinator") + 1].split(":")[1]
    assert argvs[1] == [sys.executable, "-m", "jaxscale", "train", "--steps", "3",
                        "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                        "--process-id", "1", "--devices", "8", "--heartbeat-timeout", "7",
                        "--shutdown-timeout", "30"]
    assert [a[a.index("--process-id") + 1] for a in argvs] == ["0", "1"]
    assert capsys.readouterr().err == (f"jaxscale launch: 2 processes x 4 CPU devices, "
                                       f"coordinator 127.0.0.1:{port}, logs in "
                                       f"{tmp_path / 'logs'}/\n")


def test_the_children_environment_and_the_line_filter():
    env = launcher.child_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "HOME": "/h"})
    assert env == {"HOME": "/h", "JAXSCALE_LAUNCHED": "1", "PYTHONUNBUFFERED": "1"}
    # the other flags reach the children (an optimization level, a dump folder)
    env = launcher.child_env({"XLA_FLAGS": "--xla_dump_to=/d --xla_force_host_platform_"
                                           "device_count=8 --xla_backend_optimization_level=1"})
    assert env["XLA_FLAGS"] == "--xla_dump_to=/d --xla_backend_optimization_level=1"
    assert not launcher.shown(b"[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of "
                       b"connected peer ranks is : 1\n")
    assert launcher.shown(b"step 10  loss 2.31\n") and launcher.shown(b"  [Gloo] quoted\n")


def test_help_explains_the_command_and_its_timeouts(main, capsys):
    with pytest.raises(SystemExit) as e:
        main("launch", "--help")
    out = " ".join(capsys.readouterr().out.split())
    assert e.value.code == 0
    assert "jaxscale launch --processes 2 --devices-per-process 4 -- train" in out
    assert "waits for a silent peer" in out and "waits at exit for the others" in out


# --- the supervisor, with fake children ------------------------------------------------------

def test_all_exit_0_streams_process_0_and_logs_every_process(bounded):
    out, err, logs = io.StringIO(), io.StringIO(), bounded / "logs"
    logs.mkdir()
    (logs / "process-5.log").write_text("from an earlier launch of 6 processes")
    assert launcher.launch(fake_argvs(bounded, "ok", "parent ok", "ok"), logs, out=out, err=err) == 0
    assert out.getvalue() == "out 0\n"
    assert err.getvalue() == "err 0\n"  # gloo's line is left out of the terminal
    assert sorted(p.name for p in logs.iterdir()) == [f"process-{i}.log" for i in range(3)]
    log = (logs / "process-1.log").read_text()
    assert "out 1" in log and "err 1" in log and "[Gloo] Rank 1" in log
    assert_all_gone(bounded, expected=4)  # the grandchild of process 1 too


def test_a_child_that_fails_ends_the_job_at_once(bounded):
    err = io.StringIO()
    t0 = time.monotonic()
    code = launcher.launch(fake_argvs(bounded, "sleep", "fail", "parent"), bounded / "logs",
                    out=io.StringIO(), err=err)
    assert code == 3 and time.monotonic() - t0 < 10
    pid = int((bounded / "pid-1").read_text())
    head, *tail = err.getvalue().splitlines()[-11:]
    assert head == (f"jaxscale launch: process 1 (pid {pid}) died: exit code 3; stopped the "
                    f"other 2 processes; its last lines ({bounded / 'logs' / 'process-1.log'}):")
    assert tail == [f"    line {k}" for k in range(5, 15)]
    assert_all_gone(bounded, expected=4)


def test_a_killed_child_is_named_with_its_signal(bounded, monkeypatch):
    monkeypatch.setattr(launcher, "TERMINATE_GRACE_S", 0.5)  # "deaf" needs SIGKILL
    err = io.StringIO()
    code = launcher.launch(fake_argvs(bounded, "sleep", "deaf", "kill"), bounded / "logs",
                    out=io.StringIO(), err=err)
    assert code == 128 + signal.SIGKILL
    pid = int((bounded / "pid-2").read_text())
    assert f"process 2 (pid {pid}) died: signal SIGKILL; stopped the other 2" in err.getvalue()
    assert "    err 2\n" in err.getvalue()
    assert_all_gone(bounded, expected=3)


# The launcher as the user runs it (cli.main, run(), a real process receiving SIGINT), with
# the fake children in place of the CLI's.
LAUNCHER = textwrap.dedent('''
    import sys
    from jaxscale.cli import main as cli
    from jaxscale.cli.commands import launch
    fake, folder, roles = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    launch.child_argv = lambda command, args, i, n, *rest: [
        sys.executable, "-c", fake, str(i), roles[i], str(n), folder]
    from jaxscale.runtime import launcher
    launcher.INTERRUPT_GRACE_S = 1.0
    sys.exit(cli.main(["launch", "--processes", str(len(roles)), "--devices-per-process", "2",
                       "--logs", folder + "/logs", "--", "train", "--steps", "1"]))
''')


@pytest.mark.slow
def test_ctrl_c_reaches_every_child_and_leaves_no_process(bounded):
    env = {k: v for k, v in os.environ.items() if k != "JAXSCALE_LAUNCHED"}
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, FAKE, str(bounded),
                             "sleep,parent,deaf"], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        while len(list(bounded.glob("ready-[0-9]"))) < 3 and proc.poll() is None:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == cli.EXIT_INTERRUPTED, err
    assert out == "out 0\nprocess 0 got SIGINT\n"
    assert "process 1 got SIGINT" in (bounded / "logs" / "process-1.log").read_text()
    assert err.splitlines()[0].startswith("jaxscale launch: 3 processes x 2 CPU devices")
    assert err.splitlines()[-1] == (f"jaxscale launch: interrupted; killed process 2, still "
                                    f"running after 1 s; logs in {bounded / 'logs'}/")
    assert_all_gone(bounded, expected=4)
