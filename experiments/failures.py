"""Lecture 13 §6 and exercise 9: hardware failures at scale and the checkpoint interval.

    python -m experiments.failures [--out runs/failures] [--parts abcd] [--json]
        [--e-steps 400] [--e-failures 3] [--e-taus 20,80,200,400]

Parts a-d run by default (seconds); part e trains for minutes and runs when --parts names
it (--parts e, or abcde); --e-steps, --e-failures and --e-taus set its size.

a. cluster MTBF = device MTBF / N for 8, 1024 and 16384 devices (50,000 h per device)
b. Young's optimal interval sqrt(2 delta M) and its waste sqrt(2 delta / M), checked against
   a numerical minimum of the first-order waste; Daly's refinement and the exact waste
   under exponential failures; waste against interval as a figure
c. exercise 9: an asynchronous checkpoint that stops training for delta/10; also counting
   the background write, during which only the previous checkpoint can be restarted from
d. delta measured on this machine: a real checkpoint of the tiny model's state after one
   AdamW step (single device, jaxscale.training.checkpoint.manager, after a warm-up save), synchronous and
   asynchronous, and Young's interval on 1024 devices with it, next to the lecture's 10 min
e. a real run with failures: `jaxscale train` (tiny model, --e-steps steps of 8 documents)
   killed with SIGKILL --e-failures times (`--inject crash@STEP`) and restarted each time
   by the supervisor (jaxscale.training.supervise) from its latest checkpoint, for each interval
   tau in --e-taus (steps; tau = steps: only the final save). Every line the runs write to
   stderr is time-stamped as it arrives; with metrics.jsonl's time_s that measures each
   run's pace, every save's delta (the step after it, less a step), every restart (from
   the crash until the first step after it is done, less a step: process start, imports,
   corpus, restore, compile) and the waste (the loop's span, first step done to last, less
   its steps at the run's pace, plus the final save). All of it in steps of each run's own
   pace (a machine busy with other work does not move one run against another), next to
   Young's delta/tau + tau/(2M) (+ R/M) and Daly's exact model; the U-shaped curve as a
   figure with sqrt(2 delta M) and the minimum of a/tau + b tau fitted to the measured
   points; the final parameters of every crashed run against the failure-free run's,
   tensor by tensor (they must be equal bit for bit: nothing lost)

Part e's failures are a Poisson process in steps of progress (crash@STEP fires as the
step is first reached, once), conditioned on its count: --e-failures crash steps drawn
uniformly from 2..steps with the seed, the same for every tau, so M = steps / failures
steps of work and every interval meets the same failures. Failures therefore strike work
only, never a save, a restart or a step computed again; for such failures Young's
delta/tau + (tau/2 + R)/M is not an approximation but the expected waste per unit of work
(each tau of work pays one save and, on average, tau/M failures of tau/2 + R each; in
whole steps a failure loses (tau - 1)/2 on average). Daly's exact model lets failures
strike the lost work and the restarts too, as a real machine's do: it is shown next to
it with R = 0 (at R/M of several, as here, e^(R/M) would make restarts struck by failures
tens of times slower). The MTBF is scaled down
so that a few hundred steps see several failures, which makes the waste large; it is
reported per unit of useful work (the fraction of the wall time is W / (1 + W)).

Everything printed is computed here with jaxscale.costmodel.failures; only the inputs (50,000 h,
10 minutes, the device counts) come from the lecture, and parts d and e measure theirs.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from experiments._runner import log, run_experiment
from jaxscale.costmodel import failures as F
from jaxscale.report import print_table, pyplot, save_figure
from jaxscale.model import config as model_config
from jaxscale.runtime import launcher

DEVICE_MTBF_H = 50_000
SAVE_MIN = 10.0
COUNTS = (8, 1024, 16384)


def _mtbf_min(n: int) -> float:
    return F.cluster_mtbf(DEVICE_MTBF_H, n) * 60


def part_a(lab, out: Path) -> dict:
    rows = [{"devices": n, "cluster_mtbf_hours": F.cluster_mtbf(DEVICE_MTBF_H, n),
             "cluster_mtbf_minutes": _mtbf_min(n)} for n in COUNTS]
    print_table(f"a. cluster MTBF = {DEVICE_MTBF_H:,} h / N", ["devices", "hours", "minutes"],
                [[r["devices"], r["cluster_mtbf_hours"], r["cluster_mtbf_minutes"]] for r in rows])
    return {"device_mtbf_hours": DEVICE_MTBF_H, "rows": rows}


def _argmin(f, lo: float, hi: float, steps: int = 20000) -> float:
    """The grid point (geometric, lo..hi) where f is least: a check on the calculus."""
    xs = [lo * (hi / lo) ** (i / steps) for i in range(steps + 1)]
    return min(xs, key=f)


def part_b(lab, out: Path) -> dict:
    rows = []
    for n in COUNTS:
        m = _mtbf_min(n)
        young = F.young_interval(SAVE_MIN, m)
        numeric = _argmin(lambda t, m=m: F.first_order_waste(t, SAVE_MIN, m), 1.0, 10 * m)
        exact_best = _argmin(lambda t, m=m: F.expected_waste(t, SAVE_MIN, m), 1.0, 10 * m)
        daly = F.daly_interval(SAVE_MIN, m)
        rows.append({"devices": n, "mtbf_minutes": m, "young_interval": young,
                     "numeric_argmin_first_order": numeric,
                     "young_waste": F.first_order_waste(young, SAVE_MIN, m),
                     "sqrt_2delta_over_M": (2 * SAVE_MIN / m) ** 0.5,
                     "daly_interval": daly, "numeric_argmin_exact": exact_best,
                     "exact_waste_young": F.expected_waste(young, SAVE_MIN, m),
                     "exact_waste_daly": F.expected_waste(daly, SAVE_MIN, m)})
    print_table(f"b. checkpoint every tau minutes, {SAVE_MIN:g} min per save: Young's tau* = "
                "sqrt(2 delta M) next to the numerical minimum of delta/tau + tau/(2M); Daly's "
                "tau* next to the exact model's minimum",
                ["devices", "M (min)", "Young tau*", "numerical", "waste sqrt(2 delta/M)",
                 "Daly tau*", "exact model's best", "exact waste at Young", "at Daly"],
                [[r["devices"], r["mtbf_minutes"], r["young_interval"],
                  r["numeric_argmin_first_order"], f"{100 * r['young_waste']:.2f}%",
                  r["daly_interval"], r["numeric_argmin_exact"],
                  f"{100 * r['exact_waste_young']:.2f}%", f"{100 * r['exact_waste_daly']:.2f}%"]
                 for r in rows])
    m = _mtbf_min(1024)
    taus = [10 * 1.05**i for i in range(110)]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(taus, [100 * F.first_order_waste(t, SAVE_MIN, m) for t in taus],
            label="first order: delta/tau + tau/(2M)")
    ax.plot(taus, [100 * F.expected_waste(t, SAVE_MIN, m) for t in taus],
            label="exact, exponential failures")
    ax.axvline(F.young_interval(SAVE_MIN, m), color="k", ls="--", lw=0.8,
               label=f"Young's tau* = sqrt(2 delta M) = {F.young_interval(SAVE_MIN, m):.0f} min")
    ax.set(xscale="log", xlabel="minutes of work between checkpoints, tau (log)",
           ylabel="time wasted (%)", ylim=(0, 40),
           title=f"1024 devices (M = {m:.0f} min), {SAVE_MIN:g} min per checkpoint")
    ax.legend(fontsize=8, loc="lower left")
    save_figure(fig, out / "b_waste_vs_interval.png")
    return {"save_minutes": SAVE_MIN, "rows": rows}


def part_c(lab, out: Path) -> dict:
    rows = []
    for n in COUNTS[1:]:
        m = _mtbf_min(n)
        # synchronous: training stops for the whole save, nothing runs in the background;
        # asynchronous: it stops for a tenth of it, and the write goes on for SAVE_MIN
        for kind, blocking, write in (("synchronous", SAVE_MIN, 0.0),
                                      ("asynchronous", SAVE_MIN / 10, SAVE_MIN)):
            tau = F.young_interval(blocking, m)
            rows.append({"devices": n, "mtbf_minutes": m, "kind": kind,
                         "blocking_minutes": blocking, "write_minutes": write, "interval": tau,
                         "waste_write_ignored": F.first_order_waste(tau, blocking, m),
                         "waste_with_write": F.first_order_waste(tau, blocking, m, write=write),
                         "interval_covers_write": tau >= write})
    print_table("c. exercise 9: an asynchronous save stops training for a tenth of the "
                f"{SAVE_MIN:g} minutes; while its write runs in the background a failure "
                "restarts from the save before (last two columns)",
                ["devices", "save", "stops training (min)", "tau* (min)",
                 "waste, write ignored", "waste, write counted", "background write (min)",
                 "tau* >= write"],
                [[r["devices"], {"synchronous": "sync", "asynchronous": "async"}[r["kind"]],
                  r["blocking_minutes"], r["interval"],
                  f"{100 * r['waste_write_ignored']:.2f}%", f"{100 * r['waste_with_write']:.2f}%",
                  r["write_minutes"], "yes" if r["interval_covers_write"] else "no"] for r in rows])
    return {"save_minutes": SAVE_MIN, "rows": rows}


def _measure_saves(directory: Path) -> dict:
    """Seconds a sync save of the tiny model's trained state holds training up, and an
    async one's blocked and background seconds (each after a warm-up save)."""
    import time
    from dataclasses import asdict

    import jax

    from jaxscale import garden
    from jaxscale.training.checkpoint.manager import Checkpointer, CheckpointOptions
    from jaxscale.training.checkpoint.meta import run_meta
    from jaxscale.parallel.plan import Plan
    from jaxscale.parallel.build import build_train_step
    from jaxscale.training.config import TrainConfig
    from jaxscale.training.reference import as_arrays, init_run

    cfg = TrainConfig(model="tiny", batch_size=8)
    plan = Plan()
    _, params, optimizer = init_run(cfg)
    init, step = build_train_step(model_config.preset(cfg.model), plan, optimizer)
    batch = as_arrays(next(garden.make_corpus(cfg.seed, 64, 8).train_batches(cfg.batch_size)))
    state, _ = step(init(params), batch)  # one step: the moments are not zeros
    meta = run_meta(cfg, plan, cfg.batch_size, [], [], [], 0)
    out = {"model": cfg.model, "plan": plan.layout(), "config": asdict(cfg)}
    for kind in ("sync", "async"):
        with Checkpointer(CheckpointOptions(str(directory / kind), every=1, keep=2,
                                            async_save=kind == "async")) as ckpt:
            for n in (1, 2):  # the first save warms up (compiles, opens Orbax's threads)
                t0 = time.perf_counter()
                ckpt.save(n, step.canonical.to_canonical(state), meta)
                t1 = time.perf_counter()
                ckpt.manager.wait_until_finished()
                t2 = time.perf_counter()
            out[kind] = {"blocked_s": t1 - t0, "background_s": t2 - t1}
    out["state_bytes"] = sum(x.nbytes for x in jax.tree.leaves(state))
    return out


def part_d(lab, out: Path) -> dict:
    import tempfile

    n = 1024
    m = _mtbf_min(n)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        saves = _measure_saves(Path(tmp))
    sources = [("lecture", SAVE_MIN * 60, 0.0),
               ("measured sync", saves["sync"]["blocked_s"], 0.0),
               ("measured async", saves["async"]["blocked_s"], saves["async"]["background_s"])]
    rows = []
    for source, delta_s, write_s in sources:
        delta = delta_s / 60  # minutes, the unit of M
        tau = F.young_interval(delta, m)
        rows.append({"source": source, "save_seconds": delta_s, "write_seconds": write_s,
                     "save_minutes": delta, "young_interval_minutes": tau,
                     "young_interval_seconds": tau * 60,
                     "waste": F.first_order_waste(tau, delta, m, write=write_s / 60)})
    print_table(f"d. delta measured here ({saves['model']} model, {saves['plan']}, "
                f"{saves['state_bytes']:,} bytes of state) against the lecture's "
                f"{SAVE_MIN:g} min: Young's tau* = sqrt(2 delta M) on {n} devices, "
                f"M = {m:.0f} min",
                ["delta from", "delta (s)", "background write (s)", "Young tau* (min)",
                 "tau* (s)", "waste at tau*"],
                [[r["source"], r["save_seconds"], r["write_seconds"],
                  r["young_interval_minutes"], r["young_interval_seconds"],
                  f"{100 * r['waste']:.3f}%"] for r in rows])
    return {"devices": n, "mtbf_minutes": m, "measured": saves, "rows": rows}


# --- e. a real run: crashes injected, each restarted by the supervisor --------------------

ROOT = Path(__file__).resolve().parents[1]
E_STEPS = 400  # training steps of every run (tiny model, E_BATCH documents per step)
E_BATCH = 8
E_FAILURES = 3  # crashes in each run: M = E_STEPS / E_FAILURES steps of work
E_TAUS = (20, 80, 200, 400)  # checkpoint intervals in steps (E_STEPS: only the final save)
E_TIMEOUT_S = 900  # one supervised run's bound

# run in a helper process, so that every line the trainers write can be time-stamped here
_SUPERVISOR = (
    "import json, sys\n"
    "from jaxscale.training.supervise import supervise\n"
    "argv, directory, restarts, path = json.loads(sys.argv[1]), sys.argv[2], "
    "int(sys.argv[3]), sys.argv[4]\n"
    "done = supervise(argv, directory, restarts)\n"
    "with open(path, 'w') as f:\n"
    "    json.dump({'returncode': done.returncode, "
    "'attempts': [vars(a) for a in done.attempts]}, f)\n")
_CRASH = re.compile(r"step (\d+): injecting fault crash@")
_RESUMED = re.compile(r"^train (\d+)/\d+ resumed at step")
_FIRST = re.compile(r"^train 1/\d+ ")
_RESTART = re.compile(r"restart \d+ of \d+ (?:from the checkpoint of step (\d+)|"
                      r"from the beginning)")


def crash_steps(steps: int, failures: int, seed: int) -> list[int]:
    """A Poisson process over steps 2..steps conditioned on `failures` arrivals: the
    arrival steps are then uniform, drawn without repeats (one crash per step at most)."""
    import numpy as np

    rng = np.random.default_rng([seed, 13])
    return sorted(int(s) for s in rng.choice(np.arange(2, steps + 1), failures, replace=False))


def _child_env() -> dict:
    """The environment of the training processes: this process's compilation cache (so
    that they run warm after the first), unbuffered output, one process, no forced
    device count (the tests force 8)."""
    import jax

    env = {k: v for k, v in os.environ.items() if k != "JAXSCALE_SUPERVISED"}
    cache = env.get("JAXSCALE_CACHE_DIR") or jax.config.jax_compilation_cache_dir
    if cache:
        env["JAXSCALE_CACHE_DIR"] = cache
    env = launcher.without_device_count(env)
    env.update(PYTHONUNBUFFERED="1", JAXSCALE_DISTRIBUTED="off")
    return env


def _kill_tree(pid: int) -> None:
    """SIGKILL a helper and every process under it (a supervised trainer outlives its
    supervisor otherwise)."""
    import signal

    def children(p):
        try:
            return [int(c) for t in os.listdir(f"/proc/{p}/task")
                    for c in open(f"/proc/{p}/task/{t}/children").read().split()]
        except OSError:
            return []
    todo, seen = [pid], []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo += children(p)
    for p in reversed(seen):
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


def _supervised(argv: list[str], directory: Path, restarts: int, work: Path, env: dict) -> dict:
    """Run `python -m jaxscale ARGV` under supervise(): its attempts, and every line the
    supervisor and its trainers wrote to stderr with the time.time() it arrived."""
    path = work / "attempts.json"
    p = subprocess.Popen([sys.executable, "-c", _SUPERVISOR, json.dumps(argv), str(directory),
                          str(restarts), str(path)], cwd=ROOT, env=env, text=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
    lines = []

    def read():
        for line in p.stderr:
            lines.append((time.time(), line.rstrip("\n")))
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        p.wait(E_TIMEOUT_S)
    except BaseException:  # the time is up, or Ctrl-C: leave no trainer behind
        _kill_tree(p.pid)
        p.wait()
        raise
    finally:
        reader.join(10)
    (work / "stderr.log").write_text("\n".join(f"{t:.3f} {x}" for t, x in lines))
    if p.returncode != 0 or not path.exists():
        raise RuntimeError(f"the supervisor exited with {p.returncode}; its output ends:\n"
                           + "\n".join(x for _, x in lines[-15:]))
    done = json.loads(path.read_text())
    if done["returncode"] != 0:
        raise RuntimeError(f"training ended with exit code {done['returncode']}; its output "
                           "ends:\n" + "\n".join(x for _, x in lines[-15:]))
    return {**done, "lines": lines}


def _step_times(out_dir: Path) -> dict[int, float]:
    """time_s of every step line of metrics.jsonl (seconds since that process's loop began)."""
    times = {}
    for line in (out_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "time_s" in r:
            times[r["step"]] = r["time_s"]
    return times


def _timeline(run: dict, tau: int, steps: int, crashes: list[int]) -> dict:
    """What each attempt of a run did and when, from the supervisor's attempts (their
    time.time()), the time-stamped stderr lines and metrics.jsonl: the step it resumed
    from, when its loop began and its first step was done, when it crashed. From these:
    the run's pace (seconds per step, a save's step left out), every restart (crash to
    the first step done, less a step), every save whose next step was timed by the same
    process, and the loop's span, from the first step done to the last: no start-up and
    no final evaluation or exit, so that a cold compilation cache is not counted as waste."""
    import statistics

    attempts, lines = run["attempts"], run["lines"]
    # one pipe carries the trainers' lines and the supervisor's notes in the order they
    # were written: attempt i's lines are those after the supervisor's i-th restart note
    segment, resume = [], [0]  # resume: the step each attempt continued from
    for _, x in lines:
        if m := _RESTART.search(x):
            resume.append(int(m.group(1) or 0))
        segment.append(len(resume) - 1)

    def within(i, pattern):
        return [(t, m) for (t, x), j in zip(lines, segment) if j == i
                and (m := pattern.search(x))]
    expected = [0] + [(c - 1) // tau * tau for c in crashes]
    if len(attempts) != len(crashes) + 1 or resume != expected:
        raise RuntimeError(f"tau={tau}: {len(attempts)} attempts resuming from {resume}; "
                           f"expected {len(crashes) + 1} from {expected} (crashes {crashes})")
    crashed = []
    for i, c in enumerate(crashes):
        hits = within(i, _CRASH)
        if [int(m.group(1)) for _, m in hits] != [c] or attempts[i]["returncode"] != -9:
            raise RuntimeError(f"tau={tau}: attempt {i} should have crashed at step {c} "
                               f"(SIGKILL): crash lines {[m.group(0) for _, m in hits]}, exit "
                               f"code {attempts[i]['returncode']}")
        crashed.append(hits[0][0])
    times = _step_times(run["out"])
    # a line of metrics.jsonl is the last attempt's to run that step and keep it
    owner = lambda k: max(i for i, s in enumerate(resume) if s < k)  # noqa: E731
    paced = [times[k] - times[k - 1] for k in range(2, steps + 1)
             if k in times and k - 1 in times and owner(k) == owner(k - 1) and (k - 1) % tau]
    t_step = statistics.fmean(paced)

    def loop_start(i):
        """When attempt i's loop began (its time_s count from there), if a line shows it."""
        if resume[i]:
            hits = within(i, _RESUMED)  # printed as the loop begins
            return hits[0][0] if hits else None
        hits = within(i, _FIRST)  # printed as step 1 is done
        return hits[0][0] - times[1] if hits and owner(1) == i else None

    def first_done(i, t0):
        """When attempt i's first step was done, if a line shows it."""
        if not resume[i]:
            hits = within(i, _FIRST)
            return hits[0][0] if hits else None
        k = resume[i] + 1
        return t0 + times[k] if t0 is not None and k in times and owner(k) == i else None

    starts = [loop_start(i) for i in range(len(attempts))]
    firsts = [first_done(i, t0) for i, t0 in enumerate(starts)]
    if firsts[0] is None or starts[-1] is None:
        raise RuntimeError(f"tau={tau}: no line shows when the first step, or the last "
                           "attempt's loop, began")
    restarts, parts = [], []
    for i in range(1, len(attempts)):
        if firsts[i] is not None:
            restarts.append(firsts[i] - crashed[i - 1] - t_step)
        else:  # it died before its next checkpoint, so no line of it was kept (nor saved)
            restarts.append(crashed[i] - crashed[i - 1] - (crashes[i] - 1 - resume[i]) * t_step)
        if firsts[i] is not None and starts[i] is not None and resume[i]:
            parts.append({"supervisor_s": attempts[i]["start"] - crashed[i - 1],
                          "start_to_loop_s": starts[i] - attempts[i]["start"],
                          "first_step_s": firsts[i] - starts[i] - t_step})
    saves = {}
    for k in range(tau, steps, tau):  # the saves before the final one, which follows the loop
        if k + 1 in times and k in times and owner(k) == owner(k + 1):
            saves[k] = times[k + 1] - times[k] - t_step
        else:
            saves[k] = None  # the last save before a crash: its next step was lost with it
    return {"resume_steps": resume, "step_s": t_step, "restarts": restarts,
            "restart_parts": parts, "saves": saves,
            "fresh_start_s": firsts[0] - attempts[0]["start"] - t_step,
            "loop_s": starts[-1] + times[steps] - firsts[0],
            "recomputed_steps": sum(c - 1 - s for c, s in zip(crashes, resume[1:]))}


def _same_state(a_dir: Path, b_dir: Path, step: int) -> dict:
    """Two checkpoints of `step` compared tensor by tensor (read_canonical)."""
    import logging

    from jaxscale.training.checkpoint.tensors import read_canonical

    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # Orbax warns of a metadata file it does not need
    try:
        a, b = read_canonical(a_dir, step), read_canonical(b_dir, step)
    finally:
        absl.setLevel(level)
    same = set(a) == set(b) and all(a[k].shape == b[k].shape for k in a)
    diff = max((float(abs(a[k].astype("float64") - b[k].astype("float64")).max())
                for k in a if k in b and a[k].shape == b[k].shape and a[k].size), default=0.0)
    return {"tensors": len(a), "identical": same and all(a[k].tobytes() == b[k].tobytes()
                                                         for k in a),
            "max_abs_diff": diff if same else float("inf")}


def _fit_minimum(taus, ys):
    """Least squares ys ~ a/tau + b tau over the measured points: a, b and the minimum
    sqrt(a/b) (None unless both are positive)."""
    import numpy as np

    if len(taus) < 2:
        return None
    t = np.asarray(taus, float)
    (a, b), *_ = np.linalg.lstsq(np.stack([1 / t, t], 1), np.asarray(ys, float), rcond=None)
    return {"a": float(a), "b": float(b),
            "tau": float(np.sqrt(a / b)) if a > 0 and b > 0 else None}


def part_e(lab, out: Path, steps: int = E_STEPS, failures: int = E_FAILURES,
           taus=E_TAUS) -> dict:
    import statistics
    import tempfile

    seed = (lab or {}).get("seed", 0)
    crashes = crash_steps(steps, failures, seed)
    taus = sorted(set(taus))
    env = _child_env()
    common = ["train", "--model", "tiny", "--steps", str(steps), "--batch-size", str(E_BATCH),
              "--eval-every", str(steps), "--seed", str(seed)]
    t_part = time.perf_counter()
    runs = {}
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        def run(name, tau, inject):
            work = Path(tmp) / name
            work.mkdir()
            argv = common + ["--out", str(work / "out"), "--checkpoint-dir", str(work / "ck"),
                             "--checkpoint-every", str(tau)] + [
                                 x for c in inject for x in ("--inject", f"crash@{c}")]
            log(f"  e: {name}: a checkpoint every {tau} steps, crashes at steps "
                f"{', '.join(map(str, inject)) or 'none'}")
            r = _supervised(argv, work / "ck", len(inject), work, env)
            r.update(out=work / "out", ck=work / "ck",
                     wall_s=r["attempts"][-1]["end"] - r["attempts"][0]["start"],
                     loss_curve=json.loads((work / "out" / "result.json").read_text())
                     ["loss_curve"])
            fired = work / "ck" / "jaxscale-faults.json"
            fired = json.loads(fired.read_text())["fired"] if fired.exists() else []
            if sorted(fired) != sorted(f"crash@{c}" for c in inject):
                raise RuntimeError(f"{name}: faults fired {fired}, injected {inject}")
            r.update(_timeline(r, tau, steps, inject))
            return r

        # failure-free, saving once, at the end: the state every crashed run must end with
        ideal = run("failure-free", steps, [])
        for tau in taus:
            runs[tau] = run(f"tau{tau}", tau, crashes)
            runs[tau]["state"] = _same_state(ideal["ck"], runs[tau]["ck"], steps)
    # every figure in units of each run's own step, so that a machine busy with other work
    # for part of the time moves no run against another; seconds are the medians'
    paces = [r["step_s"] for r in runs.values()]
    t_step = statistics.median(paces)
    deltas = [d / r["step_s"] for r in runs.values() for d in r["saves"].values()
              if d is not None]
    restarts = [x / r["step_s"] for r in runs.values() for x in r["restarts"]]
    if not deltas:
        raise RuntimeError("no save was timed: give an interval below the steps")
    delta, restart = statistics.median(deltas), statistics.median(restarts)  # in steps
    m = steps / failures  # steps of work between failures
    young_tau, daly_tau = F.young_interval(delta, m), F.daly_interval(delta, m)

    def daly(tau):  # Daly's exact model, as waste per unit of work (R = 0)
        w = F.expected_waste(tau, delta, m)
        return w / (1 - w) if w < 1 else math.inf

    rows = []
    for tau, r in runs.items():
        s = r["step_s"]
        # every save but the final one is timed by the step after it (the last before a
        # crash is not: its next step died with it, and counts at delta); the final save
        # follows the loop and counts at delta too: without failures none would be needed
        saves = [d / s if d is not None else delta for d in r["saves"].values()] + [delta]
        waste = r["loop_s"] / s - (steps - 1) + delta  # in steps: the loop less the work
        restart_steps = sum(r["restarts"]) / s
        counted = sum(saves) + r["recomputed_steps"]
        rows.append({
            "tau_steps": tau, "step_s": s, "saves": len(saves), "save_steps": sum(saves),
            "save_s": sum(saves) * s, "recomputed_steps": r["recomputed_steps"],
            "expected_recomputed_steps": failures * tau / 2,
            "restart_s": r["restarts"], "restart_parts": r["restart_parts"],
            "resume_steps": r["resume_steps"], "fresh_start_s": r["fresh_start_s"],
            "wall_s": r["wall_s"], "loop_s": r["loop_s"], "waste_s": waste * s,
            "other_s": (waste - restart_steps - counted) * s,
            "measured_waste": waste / steps,
            "measured_waste_without_restarts": (waste - restart_steps) / steps,
            "counted_waste_without_restarts": counted / steps,
            "young": F.first_order_waste(tau, delta, m), "daly_exact": daly(tau),
            "young_with_restarts": F.first_order_waste(tau, delta, m, restart),
            "state": r["state"], "loss_curve_equal": r["loss_curve"] == ideal["loss_curve"]})
    fit = _fit_minimum([r["tau_steps"] for r in rows],
                       [r["measured_waste_without_restarts"] for r in rows])
    best = min(rows, key=lambda r: r["measured_waste_without_restarts"])["tau_steps"]

    pct = lambda x: f"{100 * x:.0f}%"  # noqa: E731
    print_table(f"e. measured: the tiny model, {steps} steps of {E_BATCH} documents "
                f"({1e3 * t_step:.1f} ms each, the median run's pace), killed by SIGKILL as "
                f"steps {', '.join(map(str, crashes))} begin and restarted by the "
                f"supervisor; the failure-free run takes {ideal['wall_s']:.1f} s, "
                f"{ideal['fresh_start_s']:.1f} s of it to its first step. Wasted: the "
                "loop's span (first step done to last) less its steps at the run's pace, "
                "plus the final save (after the loop, counted at delta); other: what saves, "
                "steps computed twice and restarts leave unexplained",
                ["tau (steps)", "saves", "saving (s)", "steps computed twice (expected)",
                 "recomputing (s)", "restarts (s each)", "other (s)", "wasted (s)", "wall (s)",
                 "final state against failure-free"],
                [[r["tau_steps"], r["saves"], r["save_s"],
                  f"{r['recomputed_steps']} ({r['expected_recomputed_steps']:g})",
                  r["recomputed_steps"] * r["step_s"],
                  " + ".join(f"{x:.1f}" for x in r["restart_s"]), r["other_s"], r["waste_s"],
                  r["wall_s"],
                  (f"bit for bit ({r['state']['tensors']} tensors)" if r["state"]["identical"]
                   else f"DIFFERENT: max |diff| {r['state']['max_abs_diff']:.3g}")
                  + ("" if r["loss_curve_equal"] else ", loss curve differs")]
                 for r in rows])
    parts = [p for r in rows for p in r["restart_parts"]]
    if parts:
        split = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
        print_table(f"e. where a restart goes (medians of the {len(parts)} restarts that "
                    "resumed from a checkpoint), next to a fresh start",
                    ["from the crash", "seconds"],
                    [["to the new process (the supervisor notices, starts it)",
                      split["supervisor_s"]],
                     ["to its loop (Python, imports, corpus, model, restore)",
                      split["start_to_loop_s"]],
                     ["to its first step done, less a step (compile or cache load)",
                      split["first_step_s"]],
                     ["a fresh start, to its first step done, less a step (failure-free run)",
                      ideal["fresh_start_s"]]])
    print_table(f"e. wasted time per unit of useful work, measured, against Young's "
                f"delta/tau + tau/(2M) and Daly's exact model, with the measured delta = "
                f"{delta:.1f} steps ({delta * t_step:.3f} s, the median of {len(deltas)} "
                f"saves), M = {m:.0f} steps of work and a restart R = {restart:.0f} steps "
                f"({restart * t_step:.1f} s, the median of {len(restarts)})",
                ["tau (steps)", "measured, restarts taken out", "saves + recomputed, counted",
                 "Young delta/tau + tau/(2M)", "Daly exact (R = 0)", "measured, all",
                 "Young + R/M"],
                [[r["tau_steps"], pct(r["measured_waste_without_restarts"]),
                  pct(r["counted_waste_without_restarts"]), pct(r["young"]),
                  pct(r["daly_exact"]), pct(r["measured_waste"]),
                  pct(r["young_with_restarts"])] for r in rows])
    fit_tau = fit["tau"] if fit else None
    print_table("e. the best interval: Young's sqrt(2 delta M) and Daly's against the "
                "measured points",
                ["interval", "steps", "seconds of work"],
                [["Young sqrt(2 delta M)", young_tau, young_tau * t_step],
                 ["Daly", daly_tau, daly_tau * t_step],
                 ["measured: the best of the runs", best, best * t_step],
                 ["measured: minimum of a/tau + b tau fitted to the runs",
                  "-" if fit_tau is None else fit_tau,
                  "-" if fit_tau is None else fit_tau * t_step]])
    _plot_e(out, rows, delta, m, restart, t_step, young_tau, fit, steps)
    return {"steps": steps, "batch_size": E_BATCH, "failures": failures,
            "crash_steps": crashes, "step_s": t_step, "step_s_per_run": paces,
            "failure_free_wall_s": ideal["wall_s"], "fresh_start_s": ideal["fresh_start_s"],
            "save_delta_steps": delta, "save_delta_s": delta * t_step,
            "restart_steps": restart, "restart_s": restart * t_step, "mtbf_steps": m,
            "young_interval_steps": young_tau, "daly_interval_steps": daly_tau,
            "best_measured_tau_steps": best, "fit": fit, "rows": rows,
            "all_identical": all(r["state"]["identical"] for r in rows),
            "part_s": time.perf_counter() - t_part}


def _plot_e(out, rows, delta, m, restart, t_step, young_tau, fit, steps):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.4))
    lo, hi = min(r["tau_steps"] for r in rows) / 2, max(r["tau_steps"] for r in rows) * 1.5
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(grid, [100 * F.first_order_waste(t, delta, m) for t in grid],
            label="Young: delta/tau + tau/(2M)")
    daly = [F.expected_waste(t, delta, m) for t in grid]
    ax.plot(grid, [100 * d / (1 - d) if d < 1 else math.inf for d in daly], ls="--",
            label="Daly's exact model (failures strike lost work too)")
    taus = [r["tau_steps"] for r in rows]
    ax.plot(taus, [100 * r["measured_waste_without_restarts"] for r in rows], "ko",
            label="measured: the loop less its steps and restarts")
    ax.plot(taus, [100 * r["counted_waste_without_restarts"] for r in rows], "o", mfc="none",
            mec="C3", label="saves + steps computed twice, counted")
    ax.axvline(young_tau, color="k", ls=":", lw=0.9,
               label=f"Young's sqrt(2 delta M) = {young_tau:.0f} steps")
    if fit and fit["tau"]:
        ax.axvline(fit["tau"], color="C3", ls="-.", lw=0.9,
                   label=f"measured minimum (a/tau + b tau fitted) = {fit['tau']:.0f} steps")
    top = max(100 * r[k] for r in rows for k in (
        "measured_waste_without_restarts", "counted_waste_without_restarts", "young"))
    ax.set(xscale="log", xlabel="steps between checkpoints, tau (log)",
           ylabel="wasted time per unit of useful work (%)", ylim=(0, 1.5 * top),
           title=f"{steps} steps of {1e3 * t_step:.0f} ms, M = {m:.0f} steps, delta = "
                 f"{delta:.0f} steps ({delta * t_step:.2f} s);\nrestarts "
                 f"({restart:.0f} steps = {restart * t_step:.1f} s each) taken out")
    ax.legend(fontsize=7, loc="upper center", ncol=2)
    save_figure(fig, out / "e_waste_vs_interval.png")


PARTS = {"a": part_a, "b": part_b, "c": part_c, "d": part_d, "e": part_e}
DEFAULT_PARTS = "abcd"  # part e runs when --parts names it
TITLES = {"a": "cluster MTBF", "b": "Young and Daly intervals", "c": "asynchronous checkpoints",
          "d": "measured checkpoint time", "e": "a real run with failures and restarts"}


def main(argv=None) -> int:
    import argparse
    import functools

    ap = argparse.ArgumentParser(prog="python -m experiments.failures", add_help=False,
                                 allow_abbrev=False, usage="%(prog)s ... [part e's size]",
                                 description="part e runs only when --parts names it "
                                             "(the default here is abcd, not all); its size:")
    ap.add_argument("--e-steps", type=int, default=E_STEPS, metavar="N",
                    help=f"training steps of every run (default {E_STEPS})")
    ap.add_argument("--e-failures", type=int, default=E_FAILURES, metavar="F",
                    help=f"crashes in every run: M = N / F steps (default {E_FAILURES})")
    ap.add_argument("--e-taus", default=",".join(map(str, E_TAUS)), metavar="T,T,...",
                    help="checkpoint intervals in steps (default "
                         f"{','.join(map(str, E_TAUS))})")
    size, rest = ap.parse_known_args(argv)
    if any(a in ("-h", "--help") for a in rest):
        try:
            return run_experiment("failures", __doc__, PARTS, TITLES, lambda seed: None, rest)
        finally:
            print()
            ap.print_help()
    try:
        taus = [int(t) for t in size.e_taus.split(",")]
    except ValueError:
        ap.error(f"--e-taus takes steps separated by commas, e.g. 20,50,120, not "
                 f"{size.e_taus!r}")
    if size.e_steps < 10:
        ap.error(f"--e-steps must be at least 10, got {size.e_steps}")
    if not 1 <= size.e_failures < size.e_steps:
        ap.error(f"--e-failures must be between 1 and --e-steps - 1, got {size.e_failures}")
    if not taus or not all(1 <= t <= size.e_steps for t in taus):
        ap.error(f"every --e-taus interval must be between 1 and --e-steps "
                 f"({size.e_steps}), got {size.e_taus}")
    if min(taus) >= size.e_steps:
        ap.error(f"--e-taus needs an interval below --e-steps ({size.e_steps}): delta is "
                 "timed by the step after a save")
    if not any(len(a.split("=")[0]) >= 3 and "--parts".startswith(a.split("=")[0])
               for a in rest):
        rest = ["--parts", DEFAULT_PARTS, *rest]  # part e (minutes of training) when asked
    parts = {**PARTS, "e": functools.partial(part_e, steps=size.e_steps,
                                             failures=size.e_failures, taus=taus)}
    return run_experiment("failures", __doc__, parts, TITLES, lambda seed: {"seed": seed}, rest)


if __name__ == "__main__":
    sys.exit(main())
