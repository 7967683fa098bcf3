"""compare's supervisor: a strategy that kills its process is marked failed, the others are
kept, and every finished row reaches the caller at once (fake workers, no JAX)."""
import sys
import textwrap

import pytest

from jaxscale.compare import report
from jaxscale.compare.run import WorkerError, run_all

# A stand-in for the worker: the same protocol (spec on stdin, one JSON event per line),
# and a strategy named "boom" that aborts the process the way XLA's CPU runtime does.
FAKE = textwrap.dedent('''
    import json, os, sys
    spec = json.loads(sys.stdin.readline())
    sys.stderr.write("worker started\\n"); sys.stderr.flush()
    for s in spec["strategies"]:
        print(json.dumps({"event": "start", "name": s["name"], "mesh": "m"}), flush=True)
        if s["name"] == "boom":
            sys.stderr.write("F0000 rendezvous.cc] Termination timeout for `all reduce`\\n")
            sys.stderr.flush()
            os.abort()
        print(json.dumps({"event": "row", "row": {"name": s["name"], "status": "ok"}}),
              flush=True)
''')
PLAN = {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 0, "micro_batches": 1, "schedule": "1f1b",
        "virtual": 1, "remat": "none", "precision": "fp32"}


def _spec(*names):
    return {"strategies": [{"name": n, "plan": PLAN} for n in names]}


def test_a_crashed_strategy_is_failed_and_the_rest_still_run(capfd):
    seen, log = [], []
    rows = run_all(_spec("a", "boom", "c"), lambda rows: seen.append([r["name"] for r in rows]),
                   log.append, worker=(sys.executable, "-c", FAKE))
    assert [r["name"] for r in rows] == ["a", "boom", "c"]
    assert [r["status"] for r in rows] == ["ok", "failed", "ok"]
    assert "SIGABRT" in rows[1]["error"] and "Termination timeout" in rows[1]["error"]
    assert rows[1]["mesh"] == "dp=2"
    assert seen == [["a"], ["a", "boom"], ["a", "boom", "c"]]  # each row saved as it came
    assert capfd.readouterr().err.count("worker started") == 2  # a new worker after the crash
    assert any("boom FAILED" in line for line in log)


def test_a_worker_that_cannot_start_is_one_error():
    code = "import json, sys; sys.stdin.readline(); print(json.dumps({'event': 'error', " \
           "'message': 'no tpu devices here'}))"
    with pytest.raises(WorkerError, match="no tpu devices here"):
        run_all(_spec("a"), lambda rows: None, worker=(sys.executable, "-c", code))
    with pytest.raises(WorkerError, match=r"exit code 3\) before it started"):
        run_all(_spec("a"), lambda rows: None,
                worker=(sys.executable, "-c", "import sys; sys.exit(3)"))


def test_the_table_and_markdown_show_a_failed_row():
    ok = {"name": "single", "status": "ok", "mesh": "1 device", "max_rel_dloss": 0.0,
          "pass": True, "states_measured": 10, "states_predicted": 10, "sent_total": 0,
          "sent_predicted_total": 0, "memory": {"temporaries": 5}, "compile_s": 1.0,
          "compile_source": "cache", "step_s": 0.01, "step_s_q1": 0.009, "step_s_q3": 0.012,
          "step_ratio": 1.0, "sent": {}, "predicted": {"sent": {}}}
    bad = {"name": "3d", "status": "failed", "mesh": "dp=2 tp=2 pp=2",
           "error": "its process died (signal SIGABRT): Termination timeout"}
    result = {"model": "tiny", "devices": 8, "steps": 2, "batch_size": 32, "cores": 2,
              "rows": [ok, bad], "noise": {"tolerance": 1e-6, "why": "the floor"}}
    cols, rows = report.table_rows(result)
    assert rows[1][:4] == ["3d", "dp=2 tp=2 pp=2", "-", "FAILED"] and len(rows[1]) == len(cols)
    assert "1.0 s (cache)" in rows[0] and "10.0 ms (9.0-12.0)" in rows[0]
    md = report.markdown(result)
    assert "| 3d | dp=2 tp=2 pp=2 | - | FAILED |" in md
    assert "3d FAILED: its process died (signal SIGABRT)" in md
    assert "share this host's 2 cores" in md


def test_a_gpu_sized_model_is_refused_once_the_worker_finds_only_cpu_devices(monkeypatch,
                                                                            capsys):
    """`compare` refuses mid on CPU before JAX starts only when no accelerator plugin is
    installed; with a plugin but no device, auto falls back to the CPU, and the worker
    refuses it once it sees its devices: one error event, exit 2, nothing compiled."""
    import io
    import json

    from jaxscale.compare import worker as compare_worker
    spec = {"model": "mid", "devices": 8, "platform": "auto"}  # the suite's 8 CPU devices
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(spec) + "\n"))
    assert compare_worker.worker() == 2
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [e["event"] for e in events] == ["error"]
    assert "model 'mid' is sized for GPU/TPU" in events[0]["message"]


def test_the_mesh_label_names_every_axis_and_sequence_parallelism():
    from jaxscale.compare.run import mesh_label
    from jaxscale.parallel.plan import Plan
    assert mesh_label(Plan(dp=2, cp=2, tp=2, sequence_parallel=True).as_dict()) == \
        "dp=2 cp=2 tp=2 sp"
    assert mesh_label(Plan(cp=8).as_dict()) == "cp=8"
    assert mesh_label(Plan().as_dict()) == "1 device"
