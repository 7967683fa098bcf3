"""benchmarks/gpu_check.sh and benchmarks/mfu.py: `collect` on hand-made step outputs, the
budget skipping every step, the script's CPU dry run end to end, and mfu.py's quick run.

The scripts run in subprocesses with this environment (JAXSCALE_CACHE_DIR: the suite's
compilation cache) minus what conftest set up for its own 8 forced devices (XLA_FLAGS,
PJRT_NPROC), with PYTHON pointing at this interpreter."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import mfu

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
KINDS = {"setup", "info", "tests", "bench", "profile", "train", "compare"}
KEYS = {"benchmark", "dry_run", "date", "device", "versions", "machine", "steps", "bench_rows",
        "profile", "train", "compare", "tests", "failed", "skipped", "complete",
        "matmul_peak_flops_per_s", "datasheet_peak_flops_per_s", "budget_s", "wall_s"}


def script_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC")}
    env["PYTHON"] = sys.executable
    return env


def gpu_check(*args, timeout=300):
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=script_env(),
                          capture_output=True, text=True, timeout=timeout)


# --- hand-made inputs for collect

def bench_output(model, batch, remats, unroll=False, top_ops=None):
    """What `jaxscale bench --json` prints, reduced to the fields collect reads."""
    peak = {"flops_per_s": 800e12, "n": 8192, "dtype": "bfloat16", "iters": 20,
            "seconds": 0.03, "device_kind": "NVIDIA H200", "platform": "gpu"}
    rows = []
    for i, remat in enumerate(remats):
        step_s = 0.1 * (1 + i)
        tokens = batch * 1024 / step_s
        total = 2_000_000_000
        rows.append({
            "config": {"model": model, "batch_size": batch, "precision": "bf16",
                       "remat": remat, "attention": "cudnn", "unroll": unroll, "steps": 10,
                       "warmup": 2},
            "device_kind": "NVIDIA H200", "platform": "gpu", "compile_s": 12.5,
            "step_s": step_s, "step_s_all": [step_s] * 10, "tokens_per_s": tokens,
            "flops": {"total": total, "total_causal": total - 10},
            "achieved_flops_per_s": total * tokens, "compute_dtype": "bfloat16",
            "datasheet_peak": 989e12, "mfu_datasheet": total * tokens / 989e12,
            "matmul_peak": 800e12, "mfu_matmul": total * tokens / 800e12,
            "mfu_causal_datasheet": (total - 10) * tokens / 989e12,
            "xla_flops_per_token": 1.5e9, "allocator_peak_bytes": (20 + i) * 2 ** 30,
            "memory": {"arguments": 2 ** 30, "outputs": 2 ** 30, "aliased": 2 ** 30,
                       "temporaries": (19 + i) * 2 ** 30, "peak": 0},
            "extra": {} if top_ops is None else {"top_ops": top_ops, "profile": "/tmp/p"}})
    return {"device_kind": "NVIDIA H200", "platform": "gpu", "matmul_peak": peak,
            "datasheet_peak": 989e12, "convention": "6N + 12 L s d", "rows": rows,
            "jax": "0.10.2"}


TRAIN = {"config": {"model": "mid", "batch_size": 8, "precision": "bf16",
                    "attention": "cudnn"},
         "entropy_floor": 0.82, "loss_curve": [4.8, 4.0, 3.0, 2.0, 1.5, 1.2, 1.0, 0.95],
         "val_curve": [[4, 1.9], [8, 0.93]], "val_loss": 0.93, "gap": 0.11, "steps_run": 8,
         "compile_s": 20.0, "train_s": 30.0, "tokens_per_s": 2e5, "reached_gap_at_s": None,
         "nonfinite_step": None}
COMPARE = {"model": "small", "devices": 1, "steps": 10, "all_pass": True,
           "rows": [{"name": "single", "status": "ok", "pass": True, "max_rel_dloss": 0.0,
                     "compile_s": 3.0, "step_s": 0.01, "step_ratio": 1.0}]}


def test_collect_assembles_the_steps_into_one_json(tmp_path, capsys):
    work = tmp_path / "work"
    work.mkdir()
    steps = [  # NAME KIND STATUS RC START END TIMEOUT COMMAND
        ("install", "setup", "not-needed", "0", "", "", "60", "jaxscale imports from here"),
        ("machine", "info", "ok", "0", "100.0", "100.5", "20", "nvidia-smi"),
        ("devices", "info", "ok", "0", "100.5", "104.0", "60", "python -c ..."),
        ("gpu-tests", "tests", "ok", "0", "104.0", "150.25", "120", "pytest -m gpu"),
        ("bench-mid-scan-b8", "bench", "ok", "0", "150,25", "180,75", "90", "jaxscale bench"),
        ("bench-1b-scan-b4", "bench", "failed", "1", "181.0", "190.0", "100", "jaxscale bench"),
        ("profile-mid-b16", "profile", "ok", "0", "190.0", "200.0", "60", "jaxscale bench"),
        ("train-mid", "train", "ok", "0", "200.0", "260.0", "120", "jaxscale train"),
        ("compare-small", "compare", "timeout", "124", "260.0", "350.0", "90", "compare"),
        ("bench-mid-unroll-b16", "bench", "skipped", "", "", "", "150", "jaxscale bench")]
    (work / "steps.tsv").write_text("".join("\t".join(s) + "\n" for s in steps))
    (work / "machine.out").write_text("NVIDIA-SMI 570.00   H200\n")
    (work / "devices.out").write_text("[CudaDevice(id=0)]\n")
    (work / "gpu-tests.out").write_text("...\n4 passed in 45.10s\n")
    (work / "bench-mid-scan-b8.out").write_text(
        json.dumps(bench_output("mid", 8, ["matmuls", "none"])) + "\n")
    (work / "bench-1b-scan-b4.out").write_text("")  # it crashed: nothing on stdout
    top = [{"name": "cudnn-fmha", "total_ms": 5.0, "count": 48, "share": 0.3}]
    (work / "profile-mid-b16.out").write_text(
        "a warning line\n" + json.dumps(bench_output("mid", 16, ["none"], top_ops=top)))
    (work / "train-mid.out").write_text(json.dumps(TRAIN))
    (work / "compare-small.out").write_text(json.dumps(COMPARE))
    out = tmp_path / "gpu.json"

    assert mfu.main(["collect", "--work", str(work), "--out", str(out), "--platform", "gpu",
                     "--budget", "480"]) == 0
    printed = capsys.readouterr().out
    got = json.loads(out.read_text())
    assert KEYS <= set(got) and got["dry_run"] is False
    assert [s["name"] for s in got["steps"]] == [s[0] for s in steps]
    by = {s["name"]: s for s in got["steps"]}
    assert by["bench-mid-scan-b8"]["seconds"] == pytest.approx(30.5)  # a decimal comma too
    assert by["gpu-tests"]["seconds"] == pytest.approx(46.25)
    assert by["bench-1b-scan-b4"]["rc"] == 1 and by["compare-small"]["rc"] == 124
    assert by["bench-mid-unroll-b16"]["rc"] is None and by["install"]["seconds"] is None
    assert got["failed"] == ["bench-1b-scan-b4", "compare-small"]
    assert got["skipped"] == ["bench-mid-unroll-b16"] and got["complete"] is False
    assert got["device"]["device_kind"] == "NVIDIA H200"
    assert got["device"]["jax_devices"] == "[CudaDevice(id=0)]"
    assert got["device"]["nvidia_smi"].startswith("NVIDIA-SMI")
    assert got["datasheet_peak_flops_per_s"] == 989e12
    assert got["matmul_peak_flops_per_s"]["median"] == 800e12

    rows = got["bench_rows"]
    assert [r["label"] for r in rows] == ["mid b8 bf16 matmuls scan cudnn",
                                          "mid b8 bf16 none scan cudnn"]
    assert rows[0]["step_ms"] == pytest.approx(100.0)
    assert rows[0]["tokens_per_s"] == pytest.approx(8 * 1024 / 0.1)
    assert rows[0]["mfu_datasheet"] == pytest.approx(2e9 * 8 * 1024 / 0.1 / 989e12)
    assert rows[0]["step_memory_gib"] == pytest.approx(20.0)
    assert rows[1]["row"]["config"]["remat"] == "none"  # the whole row is kept
    assert got["profile"]["rows"][0]["top_ops"] == top
    assert got["tests"]["summary"] == "4 passed in 45.10s"
    t = got["train"]["summary"]
    assert t["loss_fell"] and t["train_loss_first"] > t["train_loss_last"]
    assert t["entropy_floor"] == 0.82 and got["train"]["result"]["steps_run"] == 8
    assert got["compare"]["summary"]["all_pass"] is True
    assert got["versions"]["jax"] is not None

    # the table: every bench row, the profiled one, both MFUs
    assert "MFU datasheet" in printed and "MFU matmul" in printed
    assert "mid b8 bf16 none scan cudnn" in printed and "mid b16 bf16 none" in printed
    mfu_none = rows[1]["mfu_datasheet"]
    assert f"{mfu_none:.1%}" in printed
    assert "failed: bench-1b-scan-b4, compare-small" in printed


def test_collect_with_no_steps_writes_an_empty_record(tmp_path):
    (tmp_path / "w").mkdir()
    out = tmp_path / "x.json"
    assert mfu.main(["collect", "--work", str(tmp_path / "w"), "--out", str(out),
                     "--platform", "cpu"]) == 0
    got = json.loads(out.read_text())
    assert got["steps"] == [] and got["bench_rows"] == [] and got["dry_run"] is True


def test_a_spent_budget_skips_every_step_and_records_it(tmp_path):
    """--budget 0: nothing runs (install may be not-needed), everything is recorded as
    skipped, nothing failed (exit 0), and the dry run never writes gpu.json."""
    r = gpu_check("--platform", "cpu", "--budget", "0", "--out", str(tmp_path),
                  "--work", str(tmp_path / "work"), timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads((tmp_path / "gpu-cpu-dry-run.json").read_text())
    assert not (tmp_path / "gpu.json").exists()
    assert (tmp_path / "gpu_check-cpu-dry-run.log").exists()
    statuses = {s["name"]: s["status"] for s in got["steps"]}
    assert set(statuses.values()) <= {"skipped", "not-needed"}
    assert {s["kind"] for s in got["steps"]} == KINDS
    assert got["failed"] == [] and got["complete"] is False
    assert set(got["skipped"]) == {k for k, v in statuses.items() if v == "skipped"}


def test_bad_options_are_refused():
    r = gpu_check("--platform", "tpu", timeout=30)
    assert r.returncode == 2 and "gpu or cpu" in r.stderr
    r = gpu_check("--budget", "soon", timeout=30)
    assert r.returncode == 2 and "whole seconds" in r.stderr


@pytest.mark.slow
def test_the_cpu_dry_run_of_gpu_check_passes_every_step(tmp_path):
    """The whole script on this CPU (tiny and tiny8 models, 2 timed steps): every step runs
    and exits 0, and the JSON has the bench rows, the profile's top ops, train's falling
    loss and compare's result. It checks the script, not speed: the budget and the CPU
    timeouts are generous (a cold compile on two cores loaded by the suite's other worker
    took 45 s for one config)."""
    r = gpu_check("--platform", "cpu", "--budget", "1200", "--out", str(tmp_path),
                  "--work", str(tmp_path / "work"), timeout=1500)
    got = json.loads((tmp_path / "gpu-cpu-dry-run.json").read_text())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert not (tmp_path / "gpu.json").exists()
    assert KEYS <= set(got) and got["dry_run"] is True and got["complete"] is True
    assert {s["kind"] for s in got["steps"]} == KINDS
    for s in got["steps"]:
        assert s["rc"] == 0 and s["status"] in ("ok", "not-needed"), s
    rows = got["bench_rows"]
    assert {(r["model"], r["unroll"]) for r in rows} == {("tiny", False), ("tiny", True),
                                                        ("tiny8", False), ("tiny8", True)}
    assert {r["remat"] for r in rows} == {"none", "matmuls"}
    for row in rows:
        assert row["tokens_per_s"] > 0 and 0 < row["mfu_matmul"] < 1.5
        assert row["mfu_datasheet"] is None  # a CPU has no datasheet peak
    assert got["profile"]["rows"][0]["top_ops"]
    assert got["train"]["summary"]["loss_fell"]
    assert got["compare"]["summary"]["all_pass"] is True
    assert got["device"]["platform"] == "cpu"
    log = (tmp_path / "gpu_check-cpu-dry-run.log").read_text()
    assert "CpuDevice" in log and "MFU matmul" in r.stdout


@pytest.mark.slow
def test_mfu_quick_run_writes_its_json(tmp_path):
    out = tmp_path / "mfu.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "mfu.py"), "--quick",
                        "--out", str(out)], cwd=ROOT, env=script_env(), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["quick"] is True and got["device"] == {"device_kind": "cpu",
                                                      "platform": "cpu", "devices": 1}
    assert set(got["configs"]) == {"tiny b4", "tiny b4 unroll", "tiny b4 xla"}
    for c in got["configs"].values():
        assert c["tokens_per_s"] > 0 and 0 < c["mfu_matmul"] < 1.5
    assert {c["numerator"] for c in got["comparisons"].values()} == {"tiny b4 unroll",
                                                                      "tiny b4 xla"}
    assert got["matmul_peak_gflops_per_s"]["median"] > 0 and got["versions"]["jax"]
