"""Checkpoints written before the redesign still resume, bit for bit, under the new code.

`fixtures/checkpoint_pre_redesign/3` was written by `main` at the commit named in
`expected.json` (`written_by`), by `make.py` beside it: the tiny model trained under
dp=2 with ZeRO-3, saved at step 3 of 6. The same script then resumed it under four plans
and recorded each continued loss curve and a SHA-256 of the final canonical state. Here the
current code resumes the same files under the same four plans.

Tolerance: on the CPU that wrote the fixture (`cpu` in expected.json) the curves and the
final state must be bit-identical (max abs diff 0.0): the redesign moves code, it must not
change one operation. On another kind of CPU the same fp32 program can round differently
(DESIGN: 10 ulps seen between two machines), so there each loss must agree within
sqrt(n) fp32 epsilons of the batch's n target tokens, relative (about 3e-6 here).
"""
import hashlib
import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from jaxscale.training.checkpoint import manager as C
from jaxscale.training.checkpoint import tensors
from jaxscale.model.config import preset
from jaxscale.training.config import TrainConfig
from jaxscale.training.loop import train

pytestmark = pytest.mark.slow

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoint_pre_redesign"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())


def _same_cpu() -> bool:
    lines = [line for line in open("/proc/cpuinfo") if line.startswith("model name")]
    return bool(lines) and lines[0].split(":")[1].strip() == EXPECTED["cpu"]


@pytest.mark.parametrize("target", sorted(EXPECTED["continued"]))
def test_a_pre_redesign_checkpoint_resumes_as_the_old_code_did(tmp_path, target):
    want = EXPECTED["continued"][target]
    shutil.copytree(FIXTURE / "3", tmp_path / "3")
    cfg = replace(TrainConfig(**EXPECTED["config"]), **want["fields"])
    r = train(cfg, progress=False,
              checkpoint=C.CheckpointOptions(str(tmp_path), every=6, resume=True))
    assert r.resumed_from == 3
    got, old = np.array(r.loss_curve), np.array(want["loss_curve"])
    if _same_cpu():
        assert np.max(np.abs(got - old)) == 0.0, (target, got, old)
        canon = tensors.read_canonical(tmp_path, 6)
        sha = hashlib.sha256(b"".join(np.ascontiguousarray(canon[k]).tobytes()
                                      for k in sorted(canon))).hexdigest()
        assert sha == want["final_bytes_sha"], target
    else:
        n_tokens = cfg.batch_size * preset(cfg.model).seq_len
        bound = np.sqrt(n_tokens) * np.finfo(np.float32).eps
        assert np.max(np.abs(got - old) / np.abs(old)) <= bound, (target, got, old)
