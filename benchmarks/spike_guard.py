"""Benchmark: what the spike guard costs a training step (target <= 2% of step time).

    python benchmarks/spike_guard.py [--rounds 300] [--budget 120] [--models tiny,small]

On 8 forced CPU devices, models tiny and small (batch 32, AdamW with train's schedule,
built by `build_train_step` as `train` builds them), plans one device, dp=8, dp=8 ZeRO-3
and dp=2,tp=2,pp=2 (4 micro-batches):

- plain    `step.jitted(state, batch)`: the compiled step train runs without a guard
- guarded  `step.guarded(state, batch, guard)`: its guarded twin, the guard placed once,
           its limits finite and wide enough to accept (10x the step's loss and gradient
           norm), so the update is applied and both programs do the same work

and, for the models in --loop-models (default tiny: there a step is short enough for the
host side to matter), the calls exactly as train's loop makes them, host side included:

- train_plain    `step(state, batch)` (PlanStep.__call__ without a guard)
- train_guarded  `step(state, batch, Guard.make(*window.limits()))`: the limits of a full
                 rolling window (50, train's default, around this step's loss and norm,
                 so it accepts), Guard.make, place_guard, the guarded program

Neither program donates its input, so every call steps the same state on the same batch;
a check before timing asserts that the guarded step accepts and returns the plain step's
state bit for bit. Timing: each call alone (dispatch to block_until_ready of the whole
output), every variant once per round, the order rotated from round to round, so noise on
a shared 2-core machine hits all alike; up to --rounds rounds per configuration, fewer
where the steps are slow (--budget seconds of timed calls). The ratio is the median over
rounds of guarded / plain within a round (a bootstrap 95% interval beside it), and the
ratio of the two medians.

Host side, timed alone in microseconds and as a share of the plain step: Window.limits(),
Guard.make, place_guard (the device_put of the guard's scalars onto the plan's mesh), and
beside it one device_put of the same values as a single float32 array.
HLO of both optimised programs: instructions, fusions and selects (in the entry
computation and in all), XLA's bytes accessed and flops. Writes
benchmarks/results/spike_guard.json.
"""
import argparse
import hashlib
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxscale.runtime.devices import force_cpu_devices  # noqa: E402

force_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from jaxscale import garden  # noqa: E402
from jaxscale.model import transformer as M, precision  # noqa: E402
from jaxscale.training import spikes  # noqa: E402
from jaxscale.training.checkpoint.meta import versions  # noqa: E402
from jaxscale.runtime.compile_cache import enable_compilation_cache  # noqa: E402
from jaxscale.parallel.step import shard_step  # noqa: E402
from jaxscale.parallel.plan import Plan  # noqa: E402
from jaxscale.parallel.build import build_train_step  # noqa: E402
from jaxscale.training.config import TrainConfig, lr_schedule, make_optimizer  # noqa: E402
from jaxscale.training.reference import as_arrays  # noqa: E402
from jaxscale.model import config as model_config
from jaxscale.parallel import step as steplib

BATCH = 32
TARGET = 0.02
WINDOW = TrainConfig().spike_window
PLANS = {"single": Plan(), "dp8": Plan(dp=8), "dp8_zero3": Plan(dp=8, zero_stage=3),
         "dp2_tp2_pp2_m4": Plan(dp=2, tp=2, pp=2, micro_batches=4)}
MODELS = ("tiny", "small")
UPDATE_PLANS = ("single", "dp8")  # update-only programs: the layouts make_step runs as is


def sources() -> dict:
    """Short hashes of the files whose code is measured (the record says which code ran)."""
    files = ("jaxscale/model/precision.py", "jaxscale/training/spikes.py", "jaxscale/parallel/data_parallel.py",
             "jaxscale/parallel/zero.py", "jaxscale/parallel/hybrid.py", "jaxscale/parallel/step.py",
             "jaxscale/training/loop.py", "jaxscale/training/hooks.py",
             "benchmarks/spike_guard.py")
    return {f: hashlib.sha256((ROOT / f).read_bytes()).hexdigest()[:12] for f in files}


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def _entry(text: str) -> list[str]:
    lines, inside = [], False
    for ln in text.splitlines():
        if ln.startswith("ENTRY"):
            inside = True
        elif inside and ln.strip() == "}":
            break
        elif inside:
            lines.append(ln)
    return lines


def hlo_counts(compiled) -> dict:
    """Instructions, fusions and selects of an optimised program (all computations, and
    the entry computation alone: a pass over a tensor of its own), bytes accessed, flops."""
    text = compiled.as_text()
    every = [ln for ln in text.splitlines() if " = " in ln]
    entry = _entry(text)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    count = lambda lines, op: sum(bool(re.search(rf"\b{op}\(", ln)) for ln in lines)  # noqa: E731
    return {"instructions": len(every), "fusions": count(every, "fusion"),
            "selects": count(every, "select"),
            "entry_instructions": sum(" = " in ln for ln in entry),
            "entry_fusions": count(entry, "fusion"), "entry_selects": count(entry, "select"),
            "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
            "flops": float(cost.get("flops", 0.0))}


def same_bits(a, b) -> bool:
    return all(np.asarray(x).tobytes() == np.asarray(y).tobytes()
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def timed_call(fn) -> tuple[float, float]:
    """(wall, CPU) seconds of fn() until its WHOLE output (state and metrics) is ready; CPU:
    this process's, all threads (XLA's included), which other jobs' load does not inflate."""
    t0, c0 = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0, time.process_time() - c0


def rotated_rounds(fns: dict, rounds: int) -> tuple[dict, dict]:
    """Per-call wall and CPU seconds of every fn, each once per round, the order rotated
    each round."""
    names = list(fns)
    wall, cpu = {k: [] for k in names}, {k: [] for k in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            w, c = timed_call(fns[name])
            wall[name].append(w)
            cpu[name].append(c)
    return wall, cpu


def bootstrap_median(x, n=2000, seed=0) -> list:
    """95% bootstrap interval of the median of x."""
    x = np.asarray(x)
    idx = np.random.default_rng(seed).integers(0, len(x), (n, len(x)))
    return [float(q) for q in np.quantile(np.median(x[idx], axis=1), [0.025, 0.975])]


def compare(wall: dict, cpu: dict, plain: str, guarded: str) -> dict:
    a, b = wall[plain], wall[guarded]
    pair = [y / x for x, y in zip(a, b)]
    diff = [(y - x) * 1e3 for x, y in zip(a, b)]
    cpair = [y / x for x, y in zip(cpu[plain], cpu[guarded]) if x > 0]
    ma, mb = statistics.median(a), statistics.median(b)
    lo, hi = bootstrap_median(pair)
    verdict = ("within (95% interval below the target)" if hi - 1 <= TARGET else
               "over (95% interval above the target)" if lo - 1 > TARGET else
               "the target is inside the 95% interval")
    return {"ratio": statistics.median(pair), "ratio_95": [lo, hi], "verdict": verdict,
            "ratio_of_medians": mb / ma, "median_plain_ms": ma * 1e3,
            "median_guarded_ms": mb * 1e3, "difference_ms": statistics.median(diff),
            "difference_ms_95": bootstrap_median(diff),
            "quartiles_plain_ms": [float(q) * 1e3 for q in np.quantile(a, [0.25, 0.75])],
            "quartiles_guarded_ms": [float(q) * 1e3 for q in np.quantile(b, [0.25, 0.75])],
            "cpu_ratio": statistics.median(cpair), "cpu_ratio_95": bootstrap_median(cpair),
            "cpu_median_plain_ms": statistics.median(cpu[plain]) * 1e3,
            "cpu_median_guarded_ms": statistics.median(cpu[guarded]) * 1e3}


def host_us(fn, n=2000) -> float:
    """Median microseconds of one fn() call, over 40 batches of n/40 calls."""
    per, out = max(n // 40, 1), []
    for _ in range(40):
        t0 = time.perf_counter()
        for _ in range(per):
            jax.block_until_ready(fn())
        out.append((time.perf_counter() - t0) / per * 1e6)
    return statistics.median(out)


def full_window(loss: float, norm: float) -> spikes.Window:
    """A full window of train's size around this loss and norm (its limits accept both)."""
    rng = np.random.default_rng(0)
    w = spikes.Window(WINDOW, TrainConfig().spike_z)
    for x, y in zip(loss + 0.01 * rng.standard_normal(WINDOW),
                    norm * (1 + 0.05 * rng.standard_normal(WINDOW))):
        w.add(float(x), float(y))
    return w


def bench(name, mcfg, plan, optimizer, params, batch, rounds, budget_s, loop) -> dict:
    init, step = build_train_step(mcfg, plan, optimizer)
    state = init(params)
    placed = step.place_batch(batch)
    t0 = time.perf_counter()
    c_plain = step.jitted.lower(state, placed).compile()
    compile_plain = time.perf_counter() - t0
    _, m = jax.block_until_ready(c_plain(state, placed))
    loss, norm = float(m["loss"]), float(m["grad_norm"])
    guard = step.place_guard(steplib.Guard.make(10 * loss, 10 * norm))
    t0 = time.perf_counter()
    c_guarded = step.guarded.lower(state, placed, guard).compile()
    compile_guarded = time.perf_counter() - t0

    # fairness: the guarded step accepts and does exactly the plain step's work
    s_p, m_p = c_plain(state, placed)
    s_g, m_g = c_guarded(state, placed, guard)
    assert bool(m_g["accepted"]) and int(m_g["skipped"]) == 0, "the guard rejected the step"
    identical = same_bits(s_p, s_g) and float(m_p["loss"]) == float(m_g["loss"])
    window = full_window(loss, norm)
    limits = window.limits()
    assert loss <= limits[0] and norm <= limits[1], (loss, norm, limits)

    fns = {"plain": lambda: c_plain(state, placed),
           "guarded": lambda: c_guarded(state, placed, guard)}
    if loop:
        fns["train_plain"] = lambda: step(state, placed)
        fns["train_guarded"] = lambda: step(state, placed, steplib.Guard.make(*window.limits()))
        assert bool(fns["train_guarded"]()[1]["accepted"])
    for _ in range(3):  # warm-up (the jit wrappers' first calls compile from the cache)
        for f in fns.values():
            timed_call(f)
    probe = statistics.median(timed_call(fns["plain"])[0] for _ in range(3))
    n = int(min(rounds, max(20, budget_s / (len(fns) * probe))))
    wall, cpu = rotated_rounds(fns, n)

    limits_us = host_us(window.limits)
    make_us = host_us(lambda: steplib.Guard.make(*limits))
    place_us = host_us(lambda: step.place_guard(steplib.Guard.make(*limits)), 1000) - make_us
    rep = None if step.mesh is None else NamedSharding(step.mesh, P())
    one_array_us = host_us(lambda: jax.device_put(np.asarray(limits + (1.0,), np.float32),
                                                  rep), 1000)
    plain_s = statistics.median(wall["plain"])
    row = {"plan": plan.layout(), "parameters": model_config.param_count(mcfg), "rounds": n,
           "program": compare(wall, cpu, "plain", "guarded"),
           "identical_state": identical,
           "compile_s": {"plain": compile_plain, "guarded": compile_guarded},
           "host_us": {"window_limits": limits_us, "guard_make": make_us,
                       "place_guard": place_us,
                       "alternative_one_array_device_put": one_array_us,
                       "all": limits_us + make_us + place_us},
           "host_share_of_plain_step": {
               "window_limits": limits_us * 1e-6 / plain_s,
               "all": (limits_us + make_us + place_us) * 1e-6 / plain_s},
           "hlo": {"plain": hlo_counts(c_plain), "guarded": hlo_counts(c_guarded)}}
    if loop:
        row["train_call"] = compare(wall, cpu, "train_plain", "train_guarded")
    row["meets_target"] = row["program"]["ratio"] - 1 <= TARGET and (
        not loop or row["train_call"]["ratio"] - 1 <= TARGET)
    p, h = row["program"], row["hlo"]
    log(f"  {name}: plain {p['median_plain_ms']:.2f} ms, guarded {p['median_guarded_ms']:.2f} "
        f"ms, ratio {p['ratio']:.4f} [{p['ratio_95'][0]:.4f}, {p['ratio_95'][1]:.4f}] "
        f"(of medians {p['ratio_of_medians']:.4f}, CPU {p['cpu_ratio']:.4f}; {n} rounds)"
        + (f"; train's calls {row['train_call']['ratio']:.4f} "
           f"[{row['train_call']['ratio_95'][0]:.4f}, {row['train_call']['ratio_95'][1]:.4f}]"
           if loop else "")
        + f"; host: limits {limits_us:.1f} us, make {make_us:.1f} us, place {place_us:.1f} us "
        f"({100 * row['host_share_of_plain_step']['all']:.2f}% of a step); entry fusions "
        f"{h['plain']['entry_fusions']} -> {h['guarded']['entry_fusions']}, bytes "
        f"{h['guarded']['bytes_accessed'] - h['plain']['bytes_accessed']:+.0f}; identical "
        f"{identical}")
    return row


def update_only(mcfg, plan, optimizer, params, batch, rounds, budget_s) -> dict:
    """The guard's device-side cost alone, in milliseconds: steplib.make_step's update
    (AdamW, the guard's selects and factors, the metrics) with the forward and backward
    pass replaced by a cheap elementwise gradient, so that the guard's extra work is not
    lost in the noise of a long step. Plan() jitted as build_train_step does, dp=8 in
    shard_step's shard_map (the update replicated on all 8 devices, as plain DP runs it)."""
    graphdef = nnx.graphdef(M.abstract(mcfg))
    pol = precision.policy("fp32")

    def grads_only(p, b, multiplier):  # depends on the parameters: nothing constant-folds
        g = jax.tree.map(lambda x: 1e-3 * x + 1e-4, p)
        first = jax.tree.leaves(p)[0]
        return 2.0 + 1e-3 * jnp.mean(first * first), g

    update = steplib.make_step(graphdef, optimizer, pol, jit=False, grad_fn=grads_only)
    init, step = build_train_step(mcfg, plan, optimizer)
    state = init(params)
    placed = step.place_batch(batch)
    if plan.n_devices == 1:
        plain_fn = guarded_fn = jax.jit(update)
    else:
        plain_fn, guarded_fn = shard_step(update, step.mesh, P())
    _, m = jax.block_until_ready(plain_fn(state, placed))
    guard = step.place_guard(steplib.Guard.make(10 * float(m["loss"]),
                                                  10 * float(m["grad_norm"])))
    c_plain = plain_fn.lower(state, placed).compile()
    c_guarded = guarded_fn.lower(state, placed, guard).compile()
    assert bool(c_guarded(state, placed, guard)[1]["accepted"])
    fns = {"plain": lambda: c_plain(state, placed),
           "guarded": lambda: c_guarded(state, placed, guard)}
    for _ in range(5):
        for f in fns.values():
            timed_call(f)
    probe = statistics.median(timed_call(fns["plain"])[0] for _ in range(5))
    n = int(min(rounds, max(50, budget_s / (2 * probe))))
    wall, cpu = rotated_rounds(fns, n)
    row = {"plan": plan.layout(), "rounds": n, "update": compare(wall, cpu, "plain", "guarded"),
           "hlo": {"plain": hlo_counts(c_plain), "guarded": hlo_counts(c_guarded)}}
    u = row["update"]
    log(f"  update only, {plan.layout()}: plain {u['median_plain_ms']:.3f} ms, guarded "
        f"{u['median_guarded_ms']:.3f} ms, difference {u['difference_ms']:+.3f} ms "
        f"[{u['difference_ms_95'][0]:+.3f}, {u['difference_ms_95'][1]:+.3f}] ({n} rounds)")
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=300, help="timed rounds per "
                    "configuration, at most (default 300)")
    ap.add_argument("--budget", type=float, default=120.0, help="seconds of timed calls per "
                    "configuration, at most (default 120; caps the rounds of slow steps)")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--loop-models", default="tiny", help="models whose train-style calls "
                    "(host side included) are timed too (default tiny)")
    ap.add_argument("--plans", default=",".join(PLANS))
    ap.add_argument("--update-rounds", type=int, default=400, help="rounds of the update-only "
                    "programs, at most (default 400)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "spike_guard.json"))
    args = ap.parse_args()
    enable_compilation_cache()
    t_start = time.perf_counter()
    cfg = TrainConfig()
    optimizer = make_optimizer(cfg.optimizer, lr_schedule(cfg))
    batch = as_arrays(next(garden.make_corpus(0).train_batches(BATCH)))
    results, updates = {}, {}
    for mname in args.models.split(","):
        mcfg = model_config.preset(mname)
        params = nnx.to_pure_dict(nnx.split(M.build(mcfg, seed=0), nnx.Param)[1])
        log(f"{mname} ({model_config.param_count(mcfg):,} parameters)")
        for pname in args.plans.split(","):
            results[f"{mname}/{pname}"] = bench(
                pname, mcfg, PLANS[pname], optimizer, params, batch, args.rounds,
                args.budget, mname in args.loop_models.split(","))
        for pname in [q for q in UPDATE_PLANS if q in args.plans.split(",")]:
            u = update_only(mcfg, PLANS[pname], optimizer, params, batch, args.update_rounds,
                            args.budget / 2)
            full = results[f"{mname}/{pname}"]["program"]["median_plain_ms"]
            u["share_of_full_step"] = u["update"]["difference_ms"] / full
            u["share_of_full_step_95"] = [d / full for d in u["update"]["difference_ms_95"]]
            updates[f"{mname}/{pname}"] = u
            log(f"    = {100 * u['share_of_full_step']:.2f}% of the full plain step "
                f"[{100 * u['share_of_full_step_95'][0]:.2f}%, "
                f"{100 * u['share_of_full_step_95'][1]:.2f}%]")
    ratios = {k: r["program"]["ratio"] for k, r in results.items()}
    train_ratios = {k: r["train_call"]["ratio"] for k, r in results.items() if "train_call" in r}
    result = {
        "benchmark": "spike_guard", "date": time.strftime("%Y-%m-%d"), "devices": 8,
        "batch": BATCH, "window": WINDOW, "target": f"guarded / plain - 1 <= {TARGET}",
        "ratios_guarded_to_plain": ratios, "ratios_train_call": train_ratios,
        "meets_target": {k: r["meets_target"] for k, r in results.items()},
        "all_meet_target": all(r["meets_target"] for r in results.values()),
        "definitions": {
            "plain": "step.jitted(state, batch): the compiled step train runs without a guard",
            "guarded": "step.guarded(state, batch, guard): its guarded twin, guard placed "
                       "once, limits 10x the loss and gradient norm (accepting)",
            "train_plain / train_guarded": "step(state, batch) / step(state, batch, "
                                           "Guard.make(*window.limits())): train's calls, "
                                           "host side included (full window of 50)",
            "ratio": "median over rounds of guarded / plain within the round (each call "
                     "timed alone, every variant once per round, order rotated per round); "
                     "ratio_95: its bootstrap 95% interval",
            "ratio_of_medians": "median guarded call / median plain call",
            "host_us": "per guarded step of train's loop, outside the programs, each timed "
                       "alone: Window.limits() on a full window, Guard.make, place_guard",
            "update_only": "make_step's update with a cheap elementwise gradient in place "
                           "of the forward and backward pass: the guard's device-side cost "
                           "alone (difference_ms, median of per-round differences), and "
                           "share_of_full_step = difference_ms / the full plain step",
            "cpu_ratio": "the same ratio over this process's CPU time (all threads)",
            "entry_fusions": "fusions of the entry computation: each a pass of its own; "
                             "the selects inside existing fusions add no pass over memory",
            "identical_state": "the guarded step's new state equals the plain step's bit "
                               "for bit (accepted, lr_factor 1)"},
        "machine": {"cpus": os.cpu_count(), "machine": platform.machine(),
                    "python": platform.python_version(), "platform": platform.platform(),
                    "loadavg_at_end": list(os.getloadavg())},
        "versions": versions(), "sources_sha256": sources(), "wall_s": None,
        "update_only": updates, "configs": results}
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    log(f"wrote {out} in {result['wall_s']:.0f} s; all within {TARGET:.0%}: "
        f"{result['all_meet_target']}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
