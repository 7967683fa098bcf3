"""compare's worker pool: every worker builds at once, then each row is timed alone, and the
run's wall time splits into phases that add up (fake workers speaking the command protocol,
no JAX)."""
import sys
import textwrap
import time

import pytest

from jaxscale.compare import report
from jaxscale.compare.run import WorkerError, _union, run_all, wall_split, worker_count

# A stand-in for compare.worker on command: "ready", then one answer a command. Building
# takes 0.4 s (3 s for "slow"), timing 0.05 s, each recording its window on the machine's
# clock as the real phases do; "boom-build" / "boom-time" abort the process in that phase,
# the way XLA's CPU runtime does.
FAKE = textwrap.dedent('''
    import json, os, sys, time
    spec = json.loads(sys.stdin.readline())
    assert spec["commands"]
    sys.stderr.write("pool worker started\\n"); sys.stderr.flush()
    say = lambda **e: print(json.dumps(e), flush=True)
    say(event="ready")
    held = {}
    for line in sys.stdin:
        c = json.loads(line)
        start = time.time()
        if c["do"] == "calibrate":
            time.sleep(0.02)
            say(event="calibration", calibration={"flops_per_s": 1.0}, window=[start, time.time()])
            continue
        name = c["name"]
        if name == "boom-" + c["do"]:
            sys.stderr.write("F0000 rendezvous.cc] Termination timeout for `all reduce`\\n")
            sys.stderr.flush()
            os.abort()
        if c["do"] == "build":
            time.sleep(3.0 if name == "slow" else 0.4)
            sys.stderr.write(f"built {name}\\n"); sys.stderr.flush()
            held[name] = {"name": name, "status": "ok", "built_by": os.getpid(),
                          "wall": {"compile_s": time.time() - start,
                                   "windows": {"prepare": [start, time.time()]}}}
            say(event="built", name=name)
        else:
            time.sleep(0.05)
            row = held.pop(name)
            row["wall"]["timing_s"] = time.time() - start
            row["wall"]["windows"]["time"] = [start, time.time()]
            say(event="row", row=row)
''')
WORKER = (sys.executable, "-c", FAKE)
PLAN = {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 0, "micro_batches": 1, "schedule": "1f1b",
        "virtual": 1, "remat": "none", "precision": "fp32"}


def _spec(*names, workers=2):
    return {"strategies": [{"name": n, "plan": PLAN} for n in names], "workers": workers}


def _windows(rows, phase):
    return [(r["name"], r["wall"]["windows"][phase]) for r in rows
            if phase in r.get("wall", {}).get("windows", {})]


def _assert_timed_alone(rows):
    """No row's timing window overlaps any other row's window, built or timed."""
    timed = _windows(rows, "time")
    others = timed + _windows(rows, "prepare")
    for name, (a, b) in timed:
        for other, (c, d) in others:
            if other != name:
                assert b <= c or d <= a, (name, other)


def test_rows_are_built_at_once_then_timed_alone_in_order(capfd):
    seen, log, wall = [], [], {}
    names = ["a", "b", "c", "d", "e"]
    rows = run_all(_spec(*names), lambda rows: seen.append([r["name"] for r in rows]),
                   log.append, worker=WORKER, wall=wall)
    assert [r["name"] for r in rows] == names and all(r["status"] == "ok" for r in rows)
    assert seen == [names[:i] for i in range(1, 6)]  # each row once it is final, in order
    assert capfd.readouterr().err.count("pool worker started") == 2
    assert len({r["built_by"] for r in rows}) == 2  # both workers built rows
    builds = [w for _, w in _windows(rows, "prepare")]
    assert _union(builds) < sum(b - a for a, b in builds) - 0.1  # builds ran side by side
    _assert_timed_alone(rows)
    assert max(b for _, b in builds) <= min(a for _, (a, _b) in _windows(rows, "time"))
    assert all(r["calibration"] == {"flops_per_s": 1.0} for r in rows)
    assert any("compiling in worker" in line for line in log)
    assert any("timing each strategy alone" in line for line in log)
    assert wall["workers"] == 2 and wall["rows_s"]["calibration_s"] > 0
    parts = wall["startup_s"] + wall["compile_phase_s"] + wall["timing_phase_s"]
    assert wall["other_s"] == pytest.approx(wall["total_s"] - parts)
    assert -1e-6 < wall["other_s"] < 0.5 * wall["total_s"]
    assert wall["timing_phase_s"] == pytest.approx(
        sum(b - a for _, (a, b) in _windows(rows, "time")) + wall["rows_s"]["calibration_s"])


def test_a_worker_that_dies_building_fails_that_row_only(capfd):
    log = []
    rows = run_all(_spec("a", "boom-build", "c", "d"), lambda rows: None, log.append,
                   worker=WORKER)
    assert [r["status"] for r in rows] == ["ok", "failed", "ok", "ok"]
    assert "SIGABRT" in rows[1]["error"] and "Termination timeout" in rows[1]["error"]
    assert rows[1]["mesh"] == "dp=2"
    assert any("boom-build FAILED" in line for line in log)
    _assert_timed_alone(rows)


@pytest.mark.slow
def test_a_worker_that_dies_timing_has_its_other_rows_built_again(capfd):
    """While one worker builds "slow", the other builds the rest; it dies timing
    "boom-time" with rows built and not yet timed: they are built again (a new worker
    joins), and no timing runs while they are."""
    rows = run_all(_spec("slow", "boom-time", "c", "d"), lambda rows: None,
                   lambda m: None, worker=WORKER)
    assert [r["status"] for r in rows] == ["ok", "failed", "ok", "ok"]
    assert "SIGABRT" in rows[1]["error"]
    err = capfd.readouterr().err
    assert err.count("built c") + err.count("built d") >= 3  # at least one built twice
    assert err.count("pool worker started") >= 2
    _assert_timed_alone(rows)


def test_a_pool_worker_that_cannot_start_is_one_error():
    code = "import json, sys; sys.stdin.readline(); print(json.dumps({'event': 'error', " \
           "'message': 'no tpu devices here'}))"
    with pytest.raises(WorkerError, match="no tpu devices here"):
        run_all(_spec("a", "b"), lambda rows: None, worker=(sys.executable, "-c", code))
    with pytest.raises(WorkerError, match=r"exit code 3\) before it started"):
        run_all(_spec("a", "b"), lambda rows: None,
                worker=(sys.executable, "-c", "import sys; sys.exit(3)"))


def test_interrupted_pool_leaves_no_worker(monkeypatch):
    """Ctrl-C in the supervisor (here: the first row's report raises it) kills every worker."""
    import subprocess
    started = []
    real = subprocess.Popen

    def spy(*args, **kwargs):
        started.append(real(*args, **kwargs))
        return started[-1]
    monkeypatch.setattr(subprocess, "Popen", spy)

    def interrupt(rows):
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        run_all(_spec("a", "b", "c"), interrupt, worker=WORKER)
    assert len(started) == 2 and all(p.poll() is not None for p in started)


def test_the_wall_split_of_hand_made_windows():
    assert _union([[0, 2], [1, 3], [5, 6]]) == 4 and _union([]) == 0
    rows = [{"wall": {"setup_s": 1.0, "compile_s": 2.0, "train_s": 1.0, "timing_s": 0.5,
                      "windows": {"prepare": [10, 13], "train": [13, 14], "time": [20, 20.5]}}},
            {"wall": {"compile_s": 4.0, "windows": {"prepare": [11, 19], "time": [21, 22]}}},
            {"name": "x", "status": "failed"}]
    w = wall_split(8.0, 23.0, rows, {"workers": 2, "calibration_windows": [[19, 20]]})
    assert w["total_s"] == 15 and w["startup_s"] == 2
    assert w["compile_phase_s"] == 9 and w["timing_phase_s"] == 2.5 and w["other_s"] == 1.5
    assert w["rows_s"] == {"setup_s": 1.0, "lower_s": 0.0, "compile_s": 6.0, "hlo_s": 0.0,
                           "train_s": 1.0, "timing_s": 0.5, "calibration_s": 1}
    note = report.wall_note(w)
    assert note.startswith("wall 15.0 s = start 2.0 + compile phase 9.0 (2 workers at once")
    assert "timing phase 2.5" in note and "other 1.5" in note


def test_worker_count():
    import os
    cores = len(os.sched_getaffinity(0))
    assert worker_count(15, on_cpu=True, cluster=False) == min(cores, 4)
    assert worker_count(1, on_cpu=True, cluster=False) == 1
    assert worker_count(15, on_cpu=False, cluster=False) == 1  # one accelerator's memory
    assert worker_count(15, on_cpu=True, cluster=True) == 1  # the job's processes


def test_the_table_shows_each_rows_wall_and_the_runs_split():
    wall = {"setup_s": 0.2, "lower_s": 0.3, "compile_s": 2.5, "hlo_s": 0.1, "train_s": 0.4,
            "timing_s": 0.3}
    row = {"name": "single", "status": "ok", "mesh": "1 device", "max_rel_dloss": 0.0,
           "pass": True, "states_measured": 10, "states_predicted": 10, "sent_total": 0,
           "sent_predicted_total": 0, "memory": {"temporaries": 5}, "compile_s": 2.5,
           "compile_source": "compiled", "step_s": 0.01, "step_s_q1": 0.009,
           "step_s_q3": 0.012, "step_ratio": 1.0, "sent": {}, "predicted": {"sent": {}},
           "wall": wall}
    result = {"model": "tiny", "devices": 8, "steps": 2, "batch_size": 32, "cores": 2,
              "rows": [row, {**row, "name": "old", "wall": None}],
              "noise": {"tolerance": 1e-6, "why": "the floor"},
              "wall": wall_split(0.0, 5.0, [row], {"workers": 1})}
    cols, rows = report.table_rows(result)
    at = cols.index("s: build/HLO/steps")
    assert rows[0][at] == "3.0/0.1/0.7" and rows[1][at] == "-"
    md = report.markdown(result)
    assert "wall 5.0 s = start" in md and "(1 worker;" in md


def test_timestamps_are_one_clock_across_processes():
    """The windows compare across workers only because time.time() is the machine's clock."""
    import subprocess
    before = time.time()
    child = float(subprocess.run([sys.executable, "-c", "import time; print(time.time())"],
                                 capture_output=True, text=True).stdout)
    assert before <= child <= time.time()
