"""How long a multi-process job takes to end when one of its processes is killed.

    python -m benchmarks.multiprocess_failures [--heartbeat 10] [--repeats 2]

Three cases, each a 2-process `jaxscale train` (2 CPU devices each, dp=2,tp=2) killed with
SIGKILL once both are training:
  worker       process 1 killed, no launcher: how long process 0 takes to notice (JAX's
               coordination service misses process 1's heartbeats; expected about the
               heartbeat timeout) and with which exit code;
  coordinator  process 0 killed, no launcher: process 0 hosts the coordinator service, so
               process 1 loses its connection at once;
  launcher     process 1 killed under `jaxscale launch`: how long until the launcher has
               named it, ended process 0 and exited (it does not wait for the heartbeat).
Writes benchmarks/results/multiprocess_failures.json (medians and every run).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "multiprocess_failures.json"
TRAIN = ["train", "--mesh", "dp=2,tp=2", "--steps", "100000", "--eval-every", "100000"]


def _env(cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAXSCALE_LAUNCHED")}
    return {**env, "JAXSCALE_CACHE_DIR": str(cache), "JAXSCALE_DISTRIBUTED": "off"}


def _training(out: Path, timeout: float = 300) -> None:
    """Wait until process 0 has written metrics (both processes are past compilation)."""
    jsonl, deadline = out / "metrics.jsonl", time.monotonic() + timeout
    while not (jsonl.exists() and jsonl.stat().st_size > 0):
        if time.monotonic() > deadline:
            raise TimeoutError("training did not start")
        time.sleep(0.2)
    time.sleep(1.0)


def _direct(victim: int, heartbeat: int, cache: Path, tmp: Path) -> dict:
    """Two processes started by hand; kill `victim`, time the survivor's exit."""
    from jaxscale.runtime.launcher import coordinator_port
    port, out = coordinator_port(), tmp / f"direct-{victim}-{time.monotonic_ns()}"
    procs = [subprocess.Popen(
        [sys.executable, "-m", "jaxscale", *TRAIN, "--out", str(out), "--devices", "4",
         "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i),
         "--heartbeat-timeout", str(heartbeat), "--shutdown-timeout", str(heartbeat)],
        cwd=ROOT, env=_env(cache), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for i in (0, 1)]
    try:
        _training(out)
        procs[victim].kill()
        t0 = time.monotonic()
        survivor = procs[1 - victim]
        rc = survivor.wait(timeout=heartbeat * 3 + 60)
        return {"seconds": time.monotonic() - t0, "survivor_rc": rc}
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _launched(heartbeat: int, cache: Path, tmp: Path) -> dict:
    out = tmp / f"launched-{time.monotonic_ns()}"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "jaxscale", "launch", "--processes", "2", "--devices-per-process",
         "2", "--heartbeat-timeout", str(heartbeat), "--logs", str(out / "logs"), "--", *TRAIN,
         "--out", str(out)], cwd=ROOT, env=_env(cache), stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    try:
        _training(out)
        pid = next(int(p) for p in os.listdir("/proc") if p.isdigit() and _is_process_1(p, out))
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        _, err = launcher.communicate(timeout=120)
        line = next((ln for ln in err.splitlines() if "died" in ln), "")
        return {"seconds": time.monotonic() - t0, "launcher_rc": launcher.returncode,
                "line": line.strip()}
    finally:
        launcher.kill()
        launcher.wait()


def _is_process_1(pid: str, out: Path) -> bool:
    try:
        cmd = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
    except OSError:
        return False
    return str(out) in cmd and "--process-id\x001\x00" in cmd


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heartbeat", type=int, default=10, help="heartbeat timeout, s")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    cache = ROOT / ".cache" / "bench-multiprocess"
    runs: dict[str, list] = {"worker": [], "coordinator": [], "launcher": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for case in runs:
                got = (_launched(args.heartbeat, cache, Path(tmp)) if case == "launcher"
                       else _direct(1 if case == "worker" else 0, args.heartbeat, cache,
                                    Path(tmp)))
                runs[case].append(got)
                print(f"round {r + 1} {case}: {got}", flush=True)
    result = {"heartbeat_timeout_s": args.heartbeat, "cores": os.cpu_count(),
              "python": platform.python_version(),
              "median_seconds": {k: statistics.median(x["seconds"] for x in v)
                                 for k, v in runs.items()},
              "runs": runs}
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(result, indent=1))
    for k, v in result["median_seconds"].items():
        print(f"{k:12s} survivors gone after {v:6.2f} s (median of {args.repeats})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
