"""Checkpoints written before the redesign still resume, bit for bit, under the new code.

`fixtures/checkpoint_pre_redesign/3` was written by `main` at the commit named in
`expected.json` (`written_by`), by `make.py` beside it: the tiny model trained under
dp=2 with ZeRO-3, saved at step 3 of 6. The same script then resumed it under four plans
and recorded each continued loss curve and a SHA-256 of the final canonical state. Here the
current code resumes the same files under the same four plans.

Tolerance: XLA:CPU compiles for the host's instruction set, so the reference is the old
code's own run on the same kind of CPU. Where expected.json holds a record of this CPU
(`machines`, keyed by fixtures/checkpoint_pre_redesign/machine.py's cpu_id: model name,
family, model and a digest of the feature flags; the record written by the old tree,
resuming the same files), the curves and the final state must equal it bit for bit (max
abs diff 0.0): the redesign moves code, it must not change one operation. Elsewhere, the
curves of the machine that wrote the fixture (named only "AMD EPYC", which two kinds of
EPYC share: they part by one ulp) bound each loss within sqrt(n) fp32 epsilons of the
batch's n target tokens, relative (about 3e-6 here; DESIGN: 10 ulps seen between two
machines). machine.py adds a CPU's record.
"""
import hashlib
import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from fixtures.checkpoint_pre_redesign.machine import cpu_id
from jaxscale.training.checkpoint import manager as C
from jaxscale.training.checkpoint import tensors
from jaxscale.model.config import preset
from jaxscale.training.config import TrainConfig
from jaxscale.training.loop import train

pytestmark = pytest.mark.slow

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoint_pre_redesign"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())


RECORDED = EXPECTED.get("machines", {}).get(cpu_id())  # the old code's runs on this CPU


@pytest.mark.parametrize("target", sorted(EXPECTED["continued"]))
def test_a_pre_redesign_checkpoint_resumes_as_the_old_code_did(tmp_path, target):
    want = EXPECTED["continued"][target]
    shutil.copytree(FIXTURE / "3", tmp_path / "3")
    cfg = replace(TrainConfig(**EXPECTED["config"]), **want["fields"])
    r = train(cfg, progress=False,
              checkpoint=C.CheckpointOptions(str(tmp_path), every=6, resume=True))
    assert r.resumed_from == 3
    got, old = np.array(r.loss_curve), np.array(want["loss_curve"])
    if RECORDED is not None:
        mine = RECORDED[target]
        assert np.max(np.abs(got - np.array(mine["loss_curve"]))) == 0.0, (target, got, mine)
        canon = tensors.read_canonical(tmp_path, 6)
        sha = hashlib.sha256(b"".join(np.ascontiguousarray(canon[k]).tobytes()
                                      for k in sorted(canon))).hexdigest()
        assert sha == mine["final_bytes_sha"], target
    else:
        n_tokens = cfg.batch_size * preset(cfg.model).seq_len
        bound = np.sqrt(n_tokens) * np.finfo(np.float32).eps
        assert np.max(np.abs(got - old) / np.abs(old)) <= bound, (target, got, old)
