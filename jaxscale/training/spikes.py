"""The spike guard: loss spikes caught inside the step, and undone.

A spike guard watches two global numbers of every step, the loss and the gradient norm
(the norm usually rises first), against their rolling statistics: with `window` W and
`z` k, a step is a spike when either value exceeds mean + k * std of the last W accepted
steps. No decision is made until W steps have been accepted (the statistics' warm-up).
The decision runs inside the compiled step (parallel.step.Guard carries the two limits), so a
rejected update never touches the state, and since the limits come from globally reduced
metrics every device and every process decides alike. What then happens is the policy's:

    skip      the update is dropped (parameters and optimizer state unchanged bit for
              bit), the step counted; what OLMo-core, levanter and MaxText do
    rollback  the last checkpoint is restored, the batches between it and the spike are
              skipped and the learning rate is scaled down from where it stood (so a
              second rollback lowers it again): what PaLM and OPT-175B did
    stop      the run stops after the rejected step (its state is the clean one before)

A non-finite loss or gradient is always skipped and counted, whatever the policy.

Faults that provoke spikes on purpose are `training.faults`.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, field

import numpy as np

SPIKE_POLICIES = ("none", "skip", "rollback", "stop")


class SpikeError(ValueError):
    """A spike-guard option or an injected fault that cannot be used."""


def check_options(policy: str, z: float, window: int, lr_factor: float) -> None:
    checks = [
        (policy in SPIKE_POLICIES, f"unknown spike policy {policy!r}; choose from "
                                   f"{', '.join(SPIKE_POLICIES)}"),
        (math.isfinite(z) and z > 0, f"spike z must be a positive number of standard "
                                     f"deviations, got {z}"),
        (window >= 2, f"spike window must be at least 2 steps, got {window}"),
        (math.isfinite(lr_factor) and 0 < lr_factor <= 1,
         f"the rollback learning-rate factor must be in (0, 1], got {lr_factor}"),
    ]
    for ok, msg in checks:
        if not ok:
            raise SpikeError(msg)


class Window:
    """The loss and gradient norm of the last `size` accepted steps, and the limits
    mean + z * std they set (inf until `size` steps are in: the guard's warm-up)."""

    def __init__(self, size: int, z: float):
        self.size, self.z = size, z
        self.values: deque = deque(maxlen=size)

    @classmethod
    def rebuild(cls, size, z, losses, norms, rejected) -> "Window":
        """The window after steps 1..len(losses), the rejected steps left out."""
        w = cls(size, z)
        for step, (loss, norm) in enumerate(zip(losses, norms), start=1):
            if step not in rejected:
                w.add(loss, norm)
        return w

    def add(self, loss: float, norm: float) -> None:
        self.values.append((loss, norm))

    def stats(self) -> tuple[np.ndarray, np.ndarray]:
        """(mean, std) of [loss, grad norm] over the window; std has a floor of 1e-3 x
        |mean|, so that a window of equal values does not turn every rounding into a spike."""
        v = np.asarray(self.values, np.float64).reshape(-1, 2)
        mean = v.mean(axis=0)
        return mean, np.maximum(v.std(axis=0), 1e-3 * np.abs(mean))

    def limits(self) -> tuple[float, float]:
        if len(self.values) < self.size:
            return math.inf, math.inf
        mean, std = self.stats()
        loss_max, norm_max = mean + self.z * std
        return float(loss_max), float(norm_max)


MAX_ROLLBACKS = 5  # a run that keeps spiking after this many rollbacks stops: look at it


@dataclass
class GuardState:
    """What the guard carries from step to step, saved with each checkpoint: how many
    batches rollbacks have skipped (the data position runs ahead of the step by this), the
    learning-rate factor, the rejected steps and every event so far."""

    data_offset: int = 0
    lr_factor: float = 1.0
    rejected: list = field(default_factory=list)
    events: list = field(default_factory=list)
    rollbacks: int = 0

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict | None) -> "GuardState":
        return cls(**(d or {}))
