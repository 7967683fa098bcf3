"""A checkpoint written by several processes restores in one, and one process's in several
(jax.distributed on 127.0.0.1 through `jaxscale launch`; every run bounded by a timeout)."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import CACHE, ROOT
from jaxscale.training.checkpoint import store, tensors

pytestmark = pytest.mark.slow

RUN = ["train", "--model", "tiny", "--steps", "8", "--eval-every", "4", "--batch-size", "16",
       "--train-docs", "512", "--json"]  # 8 steps read 128 documents: no process draws 8,192


def _jaxscale(*args, timeout=300):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAXSCALE_LAUNCHED")}
    env.update(JAXSCALE_CACHE_DIR=str(CACHE), JAXSCALE_DISTRIBUTED="off")
    proc = subprocess.run([sys.executable, "-m", "jaxscale", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _launch(tmp_path, name, *args):
    return _jaxscale("launch", "--processes", "2", "--devices-per-process", "2", "--logs",
                     str(tmp_path / f"logs-{name}"), "--", *RUN, *args,
                     "--out", str(tmp_path / f"out-{name}"))


def _curve(proc) -> list[float]:
    return json.loads(proc.stdout.strip().splitlines()[-1])["loss_curve"]


def _near(a, b, rel=1e-5):
    assert len(a) == len(b) == 8
    assert all(math.isclose(x, y, rel_tol=rel) for x, y in zip(a, b)), (a, b)


def test_checkpoints_move_between_process_counts(tmp_path):
    single = _curve(_jaxscale(*RUN, "--out", str(tmp_path / "single")))
    # 2 processes x 2 devices (ZeRO-3 over all 4) save step 4; one process resumes on tp x pp
    two = tmp_path / "from-two"
    _launch(tmp_path, "save", "--mesh", "dp=4", "--zero", "3", "--checkpoint-dir", str(two),
            "--checkpoint-every", "4", "--halt-after", "4")
    assert store.complete_steps(two) == [4]
    assert store.read_meta(two, 4)["processes"] == 2
    resumed = _jaxscale(*RUN, "--devices", "4", "--mesh", "pp=2,tp=2", "--micro-batches", "4",
                        "--checkpoint-dir", str(two), "--resume", "--out", str(tmp_path / "r1"))
    _near(_curve(resumed), single)
    assert "saved under dp=4,zero=3 on 2 process(es)" in resumed.stderr
    # one process (tp=2 x dp=2) saves step 4; 2 processes resume under ZeRO-1 over dp=4
    one = tmp_path / "from-one"
    _jaxscale(*RUN, "--devices", "4", "--mesh", "dp=2,tp=2", "--checkpoint-dir", str(one),
              "--checkpoint-every", "4", "--halt-after", "4", "--out", str(tmp_path / "s2"))
    launched = _launch(tmp_path, "resume", "--mesh", "dp=4", "--zero", "1", "--checkpoint-dir",
                       str(one), "--checkpoint-every", "4", "--resume")
    _near(_curve(launched), single)
    assert store.complete_steps(one) == [4, 8] and store.read_meta(one, 8)["processes"] == 2
    a, b = tensors.read_canonical(one, 8), tensors.read_canonical(two, 4)
    assert a.keys() == b.keys() and all(np.isfinite(v).all() for v in a.values())
