"""Several real processes on 127.0.0.1 (jax.distributed over gloo): equal to one process,
one voice, process-local rows, and what happens when a process dies.

Every run is bounded by a timeout, uses a free port, and the tests check afterwards that
no process of theirs is left (their command lines carry a unique folder).
"""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import CACHE, ROOT, fp32_sum_bound

pytestmark = pytest.mark.slow

BASE = ["train", "--model", "tiny", "--mesh", "dp=2,tp=2", "--batch-size", "16"]
TRAIN = [*BASE, "--steps", "30", "--eval-every", "3", "--stop-gap", "10", "--json"]


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAXSCALE_LAUNCHED")}
    return {**env, "JAXSCALE_CACHE_DIR": str(CACHE), "JAXSCALE_DISTRIBUTED": "off"}


def _jaxscale(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "jaxscale", *args], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def _ours(marker: str) -> list[int]:
    """Pids of live processes whose command line mentions `marker`."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read().decode(errors="replace")
                with open(f"/proc/{entry}/stat") as f:
                    zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
            except OSError:
                continue
            if marker in cmd and not zombie:
                pids.append(int(entry))
    return pids


def test_two_processes_train_like_one_and_stop_together(tmp_path):
    """2 processes x 2 devices against 1 process x 4, same mesh dp=2,tp=2: the same losses
    (gloo sums in another order: within fp32_sum_bound(n) = sqrt(n) eps_fp32 relative, n the
    target tokens of a step, ~330; the validation loss sums more) and both stop at the first
    validation (--stop-gap, decided on process 0 and broadcast); only process 0 writes."""
    one = _jaxscale(*TRAIN, "--devices", "4", "--out", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr[-2000:]
    launched = _jaxscale("launch", "--processes", "2", "--devices-per-process", "2",
                         "--logs", str(tmp_path / "logs"), "--",
                         *TRAIN, "--out", str(tmp_path / "two"))
    assert launched.returncode == 0, launched.stderr[-3000:]
    a, b = json.loads(one.stdout), json.loads(launched.stdout)  # stdout: exactly the JSON
    assert "[Gloo]" not in launched.stderr and "2 processes x 2 CPU devices" in launched.stderr
    assert "[Gloo] Rank 1" in (tmp_path / "logs" / "process-1.log").read_text()  # all kept
    assert a["steps_run"] == b["steps_run"] == 3  # stopped at the first validation, together
    rel = np.abs(np.subtract(a["loss_curve"], b["loss_curve"])) / np.abs(a["loss_curve"])
    assert rel.max() <= fp32_sum_bound(a["tokens_seen"] / a["steps_run"]), rel
    assert (abs(a["val_loss"] - b["val_loss"]) / a["val_loss"]
            <= fp32_sum_bound(a["tokens_seen"] / a["steps_run"]))
    assert a["tokens_seen"] == b["tokens_seen"]
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == [
        "config.toml", "loss_curve.png", "metrics.jsonl", "result.json"]  # process 0's
    quiet = (tmp_path / "logs" / "process-1.log").read_text()
    assert "loss" not in quiet and "{" not in quiet  # process 1 printed no progress, no JSON
    assert not _ours(str(tmp_path))


ROWS = r"""
import json, sys
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxscale import garden
from jaxscale.data.sampler import StepBatches
from jaxscale.runtime import processes as D
from jaxscale.runtime.mesh import make_mesh
from jax.experimental import multihost_utils
D.start(D.Cluster(f"127.0.0.1:{sys.argv[2]}", 2, int(sys.argv[1]), 5, 10), 4)
data = StepBatches(garden.make_corpus(0).train, 16, 64, seed=3, record=True)
mesh = make_mesh("dp=4")
placed = data.place(5, NamedSharding(mesh, P("dp")))
whole = multihost_utils.process_allgather(placed["tokens"], tiled=True)
print(json.dumps({"touched": data.touched, "whole": np.asarray(whole).tolist(),
                  "mine": [d.id for d in jax.local_devices()]}))
"""


def test_each_process_builds_only_its_rows_and_together_they_make_the_batch(tmp_path):
    from jaxscale import garden
    from jaxscale.runtime.launcher import coordinator_port
    from jaxscale.data.sampler import StepBatches
    port = str(coordinator_port())
    procs = [subprocess.Popen([sys.executable, "-c", ROWS, str(i), port, str(tmp_path)],
                              cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) for i in (0, 1)]
    try:
        outs = [json.loads(p.communicate(timeout=120)[0].splitlines()[-1]) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0]
    start = 5 * 16
    assert outs[0]["touched"] == list(range(start, start + 8))  # its two devices' rows
    assert outs[1]["touched"] == list(range(start + 8, start + 16))
    one = StepBatches(garden.make_corpus(0).train, 16, 64, seed=3).rows(5, 0, 16)["tokens"]
    assert np.array_equal(np.asarray(outs[0]["whole"]), one)  # bit for bit
    assert np.array_equal(np.asarray(outs[1]["whole"]), one)


def test_a_killed_process_ends_the_job_with_one_clear_line_and_no_orphans(tmp_path):
    """SIGKILL to process 1 mid-training: the launcher names it, ends process 0, exits
    128 + 9, promptly, and leaves no process behind."""
    marker = str(tmp_path / "run")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "jaxscale", "launch", "--processes", "2",
         "--devices-per-process", "2", "--logs", str(tmp_path / "logs"), "--",
         *BASE, "--steps", "100000", "--eval-every", "100000", "--out", marker],
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        log1 = tmp_path / "logs" / "process-1.log"
        while time.monotonic() < deadline:  # until process 0 has trained a few steps
            jsonl = tmp_path / "run" / "metrics.jsonl"
            if jsonl.exists() and jsonl.stat().st_size > 0 and log1.exists():
                break
            time.sleep(0.5)
        victim = [p for p in _ours(marker) if "--process-id\x001\x00" in
                  open(f"/proc/{p}/cmdline").read()]
        assert len(victim) == 1, victim
        os.kill(victim[0], signal.SIGKILL)
        killed = time.monotonic()
        _, err = launcher.communicate(timeout=60)
        took = time.monotonic() - killed
    finally:
        launcher.kill()
        launcher.wait()
    assert launcher.returncode == 128 + signal.SIGKILL, err[-2000:]
    assert f"process 1 (pid {victim[0]}) died: signal SIGKILL" in err
    assert took < 15, took  # the launcher ends the job itself, without JAX's heartbeat
    time.sleep(0.5)
    assert not _ours(marker)
