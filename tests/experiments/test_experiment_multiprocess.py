"""experiments.multiprocess end to end: two JAX processes over gloo (2 CPU devices each)
compute one step's DDP and FSDP gradients, each building only its own rows of the batch,
and match one device with the whole batch. Run once, with --json: the result on stdout,
the tables on stderr."""
import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import CACHE, ROOT

TOLERANCE = 1e-5  # the experiment's stated bound; a looser one there must fail here


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("multiprocess")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAXSCALE_LAUNCHED")}
    env["JAXSCALE_CACHE_DIR"] = str(CACHE)
    # the experiment bounds itself (--timeout) below our own bound, and kills its children
    proc = subprocess.Popen([sys.executable, "-m", "experiments.multiprocess", "--out",
                             str(out), "--timeout", "200", "--json"], cwd=ROOT, env=env,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the supervisor kills its children on SIGTERM
        stdout, stderr = proc.communicate(timeout=15)
        pytest.fail(f"experiments.multiprocess still running after 240 s:\n{stderr[-3000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr[-3000:] + (out / "process-1.log").read_text()[-2000:]
    return json.loads((out / "multiprocess.json").read_text()), stdout, stderr


@pytest.mark.slow
def test_ddp_and_fsdp_gradients_match_one_device(run):
    res, stdout, stderr = run
    assert res["tolerance_rel"] <= TOLERANCE
    for part in ("a_ddp", "b_fsdp"):
        r = res[part]
        assert r["max_rel_diff"] <= TOLERANCE, (part, r)
        assert r["max_abs_diff"] < 1e-5, (part, r)
        assert r["within_tolerance"] is True
        assert abs(r["loss"] - res["reference_loss"]) < 1e-5 * res["reference_loss"]
    # --json: stdout is exactly the object written to multiprocess.json, the tables went
    # to stderr (gloo's own lines too: they must never break the JSON)
    assert json.loads(stdout) == res
    assert "gradient of one step vs one device" in stderr and "[Gloo]" not in stdout


@pytest.mark.slow
def test_each_process_built_its_own_rows_and_held_its_own_devices(run):
    res = run[0]
    view, n = res["view"], res["batch_size"]
    assert [v["process"] for v in view] == [0, 1]
    samples = [set(v["samples"]) for v in view]
    assert not samples[0] & samples[1]  # disjoint ...
    assert samples[0] | samples[1] == set(range(n))  # ... and together the whole batch
    assert all(len(v["samples"]) == n // 2 for v in view)  # nobody built another's rows
    devices = [d for v in view for d in v["devices"]]
    assert all(d["process"] == v["process"] for v in view for d in v["devices"])
    assert all(len(v["devices"]) == res["devices_per_process"] for v in view)
    assert len({d["id"] for d in devices}) == len(devices)
    # a device's batch rows lie inside its process's samples (step 0: sample = row)
    for v in view:
        for d in v["devices"]:
            assert set(range(d["row_lo"], d["row_hi"])) <= set(v["samples"])
    # FSDP: the devices' slices of the tied embedding tile it, in mesh order
    spans = sorted((d["tok_embed_lo"], d["tok_embed_hi"]) for d in devices)
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert len({d["grad_elements"] for d in devices}) == 1  # equal slices of every tensor


@pytest.mark.slow
def test_no_worker_survives(run):
    for v in run[0]["view"]:
        with pytest.raises(ProcessLookupError):
            os.kill(v["pid"], 0)
