"""What a run reports: `TrainResult` (every figure; `jaxscale train --json` prints it) and
`TrainInterrupted`, the Ctrl-C that carries the partial result."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


class TrainInterrupted(KeyboardInterrupt):
    """Ctrl-C during `train`: the metrics so far and a partial result are written; `result`
    holds the steps that ran. A KeyboardInterrupt still, so callers stop as they would."""

    def __init__(self, result: "TrainResult"):
        super().__init__(f"interrupted after {result.steps_run} steps")
        self.result = result


@dataclass
class TrainResult:
    """Every figure of a run; `to_json()` is what `jaxscale train --json` prints."""

    config: dict
    param_count: int
    entropy_floor: float
    loss_curve: list[float]
    grad_norms: list[float]
    val_curve: list[tuple[int, float]]
    val_loss: float
    steps_run: int
    tokens_seen: int
    compile_s: float  # wall time of the first step, dominated by compilation
    train_s: float
    tokens_per_s: float
    loss_scale: float  # at the end (1.0 without loss scaling)
    skipped_steps: int  # updates skipped for non-finite gradients (dynamic loss scaling)
    reached_gap_at_s: float | None  # wall seconds from start of training to val gap <= stop_gap
    nonfinite_step: int | None = None  # the step whose loss was NaN or inf; training stopped
    interrupted: bool = False  # Ctrl-C: the steps that ran, no final validation
    halted: bool = False  # stopped by halt_after (as if interrupted; the checkpoint resumes it)
    resumed_from: int | None = None  # the checkpoint step this run continued from
    spike_events: list = field(default_factory=list)  # the guard's events (jaxscale.training.spikes)
    rollbacks: int = 0  # spike rollbacks to a checkpoint
    steps_computed: int = 0  # steps this process ran, the ones rollbacks undid included
    warmup_steps: int = 0  # the schedule's warm-up: config's warmup, at most half the steps

    @property
    def gap(self) -> float:
        return self.val_loss - self.entropy_floor

    def to_json(self) -> dict:
        """Every field and the gap; NaN and inf become null (JSON has no such numbers)."""
        d = asdict(self)
        d["gap"] = self.gap
        return json_ready(d)


def json_ready(x):
    """x with NaN and inf as None, in dicts, lists and tuples (JSON has no such numbers)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: json_ready(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_ready(v) for v in x]
    return x
