"""What the training loop and its hooks share while a run goes on: `Run`.

The loop owns the step counter and the state; each hook reads what it needs from the Run
and writes back only its own concern (the guard its decision, the validator the curve,
...). The per-step fields are set afresh every step by the loop (`Run.begin_step`).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from jaxscale.data.sampler import StepBatches
from jaxscale.model.config import ModelConfig
from jaxscale.parallel.plan import Plan
from jaxscale.training.config import TrainConfig
from jaxscale.training.result import json_ready
from jaxscale.training.spikes import GuardState


@dataclass
class Run:
    """One run's progress: its history (losses, norms, validation curve, tokens), its
    stop flags, and this step's batch, metrics and metrics-line record."""

    cfg: TrainConfig
    plan: Plan
    mcfg: ModelConfig
    step_fn: Any  # parallel.data_parallel.PlanStep
    batches: StepBatches
    floor: float
    note: Callable  # note(message, kind="warning"): warnings and notes for the user
    metrics: Any = None  # the open metrics.jsonl (process 0 with an output folder), or None
    schedule: Callable = None  # the learning rate of each step (optax.Schedule)
    clock: Callable[[], float] = time.perf_counter
    state: Any = None
    start: int = 0  # the step this run resumed from (0: a fresh run)
    end: int = 0  # train while step < end
    step: int = 0
    steps_run: int = 0  # every step computed, the ones rollbacks undid included
    losses: list = field(default_factory=list)
    norms: list = field(default_factory=list)
    val_curve: list = field(default_factory=list)
    tokens: int = 0
    tokens_before: int = 0  # tokens not computed by this process (resumed, rolled back)
    gs: GuardState = field(default_factory=GuardState)
    t_start: float = 0.0
    compile_s: float = 0.0
    reached_at: float | None = None  # seconds from the start to the stop gap
    nonfinite_at: int | None = None
    stop: bool = False  # every process stops after this step (process 0's decision)
    halted: bool = False
    interrupted: bool = False
    abort: bool = False  # stop at once, without a save (too many rollbacks)
    wants_stop: bool = False  # this process would stop after this step (the guard's wish)
    # this step's
    data_step: int = 0
    due: list = field(default_factory=list)  # the faults that fire at this step
    guard: Any = None  # parallel.step.Guard, or None for the plain step
    loss: float = 0.0
    gnorm: float = 0.0
    accepted: bool = True
    action: str | None = None  # what the guard does with a rejected step
    record: dict = field(default_factory=dict)  # this step's line of metrics.jsonl
    rolled_back: bool = False

    def begin_step(self) -> None:
        """Advance to the next step: a rollback's skipped batches put the data ahead."""
        self.step += 1
        self.data_step = self.step - 1 + self.gs.data_offset
        self.due, self.guard, self.action = [], None, None
        self.rolled_back = self.wants_stop = False

    def write(self, record: dict) -> None:
        """One line of metrics.jsonl (nothing without a metrics file)."""
        if self.metrics is not None:
            self.metrics.write(json.dumps(json_ready(record)) + "\n")


def open_metrics(path: Path, start: int):
    """metrics.jsonl for writing; resuming at `start`, the lines of steps 1..start that a
    run wrote here before are kept (a later step's line, from a run that went on past its
    last checkpoint, is dropped: those steps run again)."""
    kept = []
    if start and path.exists():
        for line in path.read_text().splitlines():
            try:  # the last line of a killed run may be half written
                if json.loads(line).get("step", 0) <= start:
                    kept.append(line)
            except ValueError:
                continue
    f = open(path, "w")
    f.writelines(line + "\n" for line in kept)
    return f


def resumed_metrics(meta: dict):
    """(losses, norms, val_curve, tokens, guard state) as a checkpoint's JSON holds them."""
    done = meta["metrics"]
    return (list(done["loss_curve"]), list(done["grad_norms"]),
            [tuple(v) for v in done["val_curve"]], done["tokens_seen"],
            GuardState.from_json(meta.get("guard")))
