"""One strategy's row, measured in three phases: prepare, train, time.

`jaxscale compare` runs its rows in worker processes (compare/run.py, compare/pool.py)
that compile while others wait, and a step timed while another process compiles would
time the compiler as much as the step. So a row's work is cut where the machine must be
quiet, and each part does its work once:

  prepare  build the plan's step, place its state and first batch, trace and lower the
           step ONCE, compile that lowering (timed, and whether the persistent cache
           supplied it), and read the rest from the same two objects: the HLO text of the
           lowering (its collectives: bytes each device sends) and XLA's memory analysis of
           the executable. The executable is the one that trains and is timed: nothing is
           traced, lowered or compiled again.
  train    the training steps on the run's batches: the loss curve (the state's bytes per
           device, the final parameters, the profile). Losses do not depend on the clock,
           so this may run while other workers compile; a profile is a picture of the
           steps' time, so with one the pool trains in the timing phase instead.
  time     the step timed (median and quartiles of `repeats` calls on the trained state):
           the one figure that needs the machine to itself.

Each phase adds its wall time to row["wall"]: seconds per part (setup_s: build and place;
lower_s: trace and lower; compile_s; hlo_s: the HLO text, its collectives and the memory
analysis; train_s; timing_s: the warm-up calls and the repeats) and the phase's window on
the machine's clock (windows: {phase: [start, end]}, time.time() seconds, comparable across
the processes of one machine), from which the supervisor splits the run's wall time and a
test checks that no timing window overlaps another process's work.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import jax

from jaxscale.measure import hlo as measure, memory, timing
from jaxscale.parallel.build import build_train_step
from jaxscale.parallel.tick_table import plan_branch_share
from jaxscale.parallel.plan import Plan
from jaxscale.parallel.schedules import bubble_over_total
from jaxscale.runtime import mesh as meshlib, processes as distributed, profiling


@dataclass
class Prepared:
    """A row between its phases: the compiled step, the state it trains and is timed on
    (the trained one once `train` ran), the placed first batch, and the row so far."""
    plan: Plan
    step: object  # parallel.step.PlanStep
    compiled: object  # jax.stages.Compiled: trains, and is timed
    state: object
    place: object  # step index -> that step's batch on the step's sharding
    placed: dict  # step 0's batch: the timed calls reuse it
    here: object  # this process's first device of the plan: memory is read there
    row: dict = field(default_factory=dict)


class _Laps:
    """Consecutive wall-clock laps: each `lap(key)` adds the seconds since the last one to
    wall[key], so a phase's parts add up to its window."""

    def __init__(self, wall: dict, phase: str):
        self.wall, self.phase = wall, phase
        self.start = time.time()
        self.last = time.perf_counter()

    def lap(self, key: str) -> None:
        now = time.perf_counter()
        self.wall[key] = self.wall.get(key, 0.0) + now - self.last
        self.last = now

    def close(self) -> None:
        self.wall.setdefault("windows", {})[self.phase] = [self.start, time.time()]


def prepare(name: str, plan: Plan, cfg, params, batches, optimizer, devices) -> Prepared:
    """Build, lower once, compile once, and read the HLO and memory (module docstring)."""
    wall: dict = {}
    laps = _Laps(wall, "prepare")
    init, step = build_train_step(cfg, plan, optimizer, devices[:plan.n_devices])
    state = jax.block_until_ready(init(params))
    place = lambda i: batches.place(i, step.batch_sharding)  # noqa: E731 - this process's rows
    placed = place(0)
    laps.lap("setup_s")
    lowered = step.jitted.lower(state, placed)
    laps.lap("lower_s")
    compiled, compile_s, source = timing.compile_timed(lowered)
    laps.lap("compile_s")
    hlo, share = lowered.as_text(dialect="hlo"), plan_branch_share(plan)
    here = next(d for d in devices[:plan.n_devices] if d.process_index == jax.process_index())
    row = {"name": name, "status": "ok", "plan": plan.as_dict(), "n_devices": plan.n_devices,
           "platform": here.platform, "device_kind": here.device_kind, "losses": [],
           "compile_s": compile_s, "compile_source": source, "step_s": None,
           "step_s_q1": None, "step_s_q3": None, "step_repeats": None,
           "memory": memory.memory(compiled),  # the state's shards join it in `train`
           "sent": measure.ring_bytes_by_op(hlo, share),
           "collectives_per_step": sum(c.times for c in measure.collectives(hlo, share)
                                       if measure.group_size(c, plan.n_devices) > 1),
           "wall": wall}
    if jax.process_count() > 1 and step.mesh is not None:  # which bytes leave the process
        row["sent_cross_process"] = measure.ring_bytes_by_op(
            hlo, share, device_process=meshlib.device_process(step.mesh))
    if share is not None:  # the idle share of the schedule the executor runs (unit ticks)
        row["idle_schedule"] = share[0]
        row["idle_formula"] = float(bubble_over_total(plan.schedule, plan.pp, plan.micro_batches,
                                                    plan.virtual))
    laps.lap("hlo_s")
    laps.close()
    return Prepared(plan, step, compiled, state, place, placed, here, row)


def train(p: Prepared, steps: int, keep_params: bool = False, profile=None) -> None:
    """The training steps: the losses, the state's bytes on this process's first device,
    and with `keep_params` the final whole parameters (host arrays by name) in
    row["_final_params"]; `profile`: a folder for a jax.profiler trace of the steps."""
    laps = _Laps(p.row["wall"], "train")
    losses = []
    prof = profiling.Profiler(profile)
    state = p.state
    with prof.trace():
        for i in range(steps):  # float() waits for each step: never runs ahead
            with prof.step(i):
                state, metrics = p.compiled(state, p.place(i))
                losses.append(float(metrics["loss"]))
    p.state = state
    on0 = lambda tree: memory.bytes_on_device(tree, p.here)  # noqa: E731
    p.row["losses"] = losses
    p.row["memory"] = {"params": on0(state.params), "master": on0(state.master),
                       "optimizer": on0(state.opt_state), **p.row["memory"]}
    if keep_params:
        p.row["_final_params"] = distributed.named_host_arrays(p.step.full_params(state))
    laps.lap("train_s")
    laps.close()


def time_step(p: Prepared, repeats: int) -> None:
    """The step timed on the trained state and step 0's batch: median and quartiles."""
    laps = _Laps(p.row["wall"], "time")
    state = p.state
    timed = timing.step_seconds(lambda: p.compiled(state, p.placed), repeats=repeats)
    p.row.update(step_s=timed["median_s"], step_s_q1=timed["q1_s"], step_s_q3=timed["q3_s"],
                 step_repeats=timed["repeats"])  # the whole output waited for, not the loss
    laps.lap("timing_s")
    laps.close()
