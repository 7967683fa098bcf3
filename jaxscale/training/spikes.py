"""Loss spikes caught and undone, and faults injected on purpose to provoke them.

A spike guard watches two global numbers of every step, the loss and the gradient norm
(the norm usually rises first), against their rolling statistics: with `window` W and
`z` k, a step is a spike when either value exceeds mean + k * std of the last W accepted
steps. No decision is made until W steps have been accepted (the statistics' warm-up).
The decision runs inside the compiled step (precision.Guard carries the two limits), so a
rejected update never touches the state, and since the limits come from globally reduced
metrics every device and every process decides alike. What then happens is the policy's:

    skip      the update is dropped (parameters and optimizer state unchanged bit for
              bit), the step counted; what OLMo-core, levanter and MaxText do
    rollback  the last checkpoint is restored, the batches between it and the spike are
              skipped and the learning rate is scaled down from where it stood (so a
              second rollback lowers it again): what PaLM and OPT-175B did
    stop      the run stops after the rejected step (its state is the clean one before)

A non-finite loss or gradient is always skipped and counted, whatever the policy.

Faults, each fired once per run (a restarted run reads which already fired from a file
beside the checkpoints, written before the fault acts):

    nan@STEP              the step's loss and gradients become NaN (a NaN in its batch)
    spike@STEP[:KIND]     the step's batch is garbage: KIND random tokens (default), one
                          token repeated (repeat), or one 8-gram repeated (ngram)
    lr@STEP:FACTOR        the learning rate is multiplied by FACTOR from STEP on (a rollback
                          to before STEP does not bring the jump back: it fired once)
    crash@STEP            the process kills itself (SIGKILL) as STEP begins
"""
from __future__ import annotations

import json
import math
import os
import signal
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

SPIKE_POLICIES = ("none", "skip", "rollback", "stop")
FAULT_KINDS = ("nan", "spike", "lr", "crash")
BAD_BATCHES = ("random", "repeat", "ngram")
FAULTS_FILE = "jaxscale-faults.json"  # in the checkpoint directory: the faults that fired


class SpikeError(ValueError):
    """A spike-guard option or an injected fault that cannot be used."""


@dataclass(frozen=True)
class Fault:
    """One injected fault: `kind` at `step`; `arg` the lr factor or the bad batch's kind."""

    kind: str
    step: int
    arg: str | None = None

    @classmethod
    def parse(cls, text: str) -> "Fault":
        """A fault written as KIND@STEP[:ARG], e.g. nan@120, lr@300:10, spike@50:repeat."""
        kind, at, rest = text.partition("@")
        step, _, arg = rest.partition(":")
        usage = ("write KIND@STEP with KIND one of " + ", ".join(FAULT_KINDS)
                 + " (lr@STEP:FACTOR, spike@STEP[:" + "|".join(BAD_BATCHES) + "])")
        if not at or kind not in FAULT_KINDS:
            raise SpikeError(f"cannot read fault {text!r}: {usage}")
        if not step.isdigit() or int(step) < 1:
            raise SpikeError(f"fault {text!r} needs a step >= 1 after '@': {usage}")
        if kind == "lr":
            try:
                factor = float(arg)
            except ValueError:
                factor = math.nan
            if not (math.isfinite(factor) and factor > 0):
                raise SpikeError(f"fault {text!r} needs a positive factor: lr@STEP:FACTOR")
        elif kind == "spike":
            arg = arg or "random"
            if arg not in BAD_BATCHES:
                raise SpikeError(f"unknown bad batch {arg!r} in {text!r}; choose from "
                                 f"{', '.join(BAD_BATCHES)}")
        elif arg:
            raise SpikeError(f"fault {text!r} takes no ':{arg}'; {usage}")
        return cls(kind, int(step), arg or None)

    def __str__(self) -> str:
        return f"{self.kind}@{self.step}" + (f":{self.arg}" if self.arg else "")


def parse_faults(texts) -> tuple[Fault, ...]:
    """Faults from their written forms, refusing two of one kind at one step."""
    faults = tuple(Fault.parse(t) for t in texts)
    seen = set()
    for f in faults:
        if (f.kind, f.step) in seen:
            raise SpikeError(f"fault {f.kind}@{f.step} given twice")
        seen.add((f.kind, f.step))
    return faults


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


class FaultLog:
    """Which injected faults have fired. With a `path` (beside the checkpoints) the record
    outlives the process: it is written, and synced, before a fault acts, so a run
    restarted after `crash@STEP` does not crash at STEP again."""

    def __init__(self, faults, path: Path | None = None, write: bool = True):
        self.faults, self.path, self.write = tuple(faults), path, write
        self.fired: set[str] = set()
        if path is not None and path.exists():
            self.fired = set(json.loads(path.read_text())["fired"])

    def due(self, step: int) -> list[Fault]:
        """The faults of `step` that have not fired yet, each recorded as fired now."""
        due = [f for f in self.faults if f.step == step and str(f) not in self.fired]
        if due:
            self.fired.update(map(str, due))
            if self.path is not None and self.write:  # several processes: process 0 writes
                self._write()
        return due

    def _write(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w") as f:
            json.dump({"fired": sorted(self.fired)}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


def bad_batch(kind: str, batch_size: int, seq_len: int, vocab: int, seed: int, step: int,
              sharding=None) -> dict:
    """A whole batch of garbage on `sharding` (None: host arrays), the same on every
    process (a function of seed and step), each process placing only its own rows."""
    rng = np.random.default_rng([seed, step, BAD_BATCHES.index(kind)])
    if kind == "random":
        seq = rng.integers(1, vocab, (batch_size, seq_len + 1))
    elif kind == "repeat":
        seq = np.repeat(rng.integers(1, vocab, (batch_size, 1)), seq_len + 1, axis=1)
    else:
        gram = rng.integers(1, vocab, (batch_size, 8))
        seq = np.tile(gram, (1, seq_len // 8 + 1))[:, :seq_len + 1]
    seq = seq.astype(np.int32)
    batch = {"tokens": seq[:, :-1], "targets": seq[:, 1:],
             "mask": np.ones((batch_size, seq_len), np.float32)}
    if sharding is None:
        return batch
    import jax
    return {k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx])
            for k, v in batch.items()}


def poison(batch: dict) -> dict:
    """The batch with one NaN in its loss mask: the loss and every gradient become NaN,
    with no change to the compiled step (the mask multiplies each token's loss)."""
    import jax
    import jax.numpy as jnp

    mask = batch["mask"]
    nan = jax.jit(lambda m: m.at[0, 0].set(jnp.nan),
                  out_shardings=getattr(mask, "sharding", None))(mask)
    return {**batch, "mask": nan}


def crash() -> None:
    """Die as a lost machine does: SIGKILL, no cleanup, no flush."""
    os.kill(os.getpid(), signal.SIGKILL)


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
