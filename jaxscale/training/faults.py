"""Faults injected on purpose, each fired once per run (a restarted run reads which already
fired from a file beside the checkpoints, written before the fault acts):

    nan@STEP              the step's loss and gradients become NaN (a NaN in its batch)
    spike@STEP[:KIND]     the step's batch is garbage: KIND random tokens (default), one
                          token repeated (repeat), or one 8-gram repeated (ngram)
    lr@STEP:FACTOR        the learning rate is multiplied by FACTOR from STEP on (a rollback
                          to before STEP does not bring the jump back: it fired once; a
                          restart from a checkpoint before STEP fires it again, as that
                          checkpoint's learning rate predates the jump)
    crash@STEP            the process kills itself (SIGKILL) as STEP begins

They come into the loop from outside (`train(..., faults=...)`); the spike guard
(`training.spikes`) is what they provoke.
"""
from __future__ import annotations

import json
import math
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxscale.files import write_text_atomically
from jaxscale.training.spikes import SpikeError


FAULT_KINDS = ("nan", "spike", "lr", "crash")
BAD_BATCHES = ("random", "repeat", "ngram")
FAULTS_FILE = "jaxscale-faults.json"  # in the checkpoint directory: the faults that fired


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


def parse_faults(texts, steps: int | None = None) -> tuple[Fault, ...]:
    """Faults from their written forms, refusing two of one kind at one step and (given the
    run's `steps`) a fault at a step the run never reaches."""
    faults = tuple(Fault.parse(t) for t in texts)
    seen = set()
    for f in faults:
        if (f.kind, f.step) in seen:
            raise SpikeError(f"fault {f.kind}@{f.step} given twice")
        if steps is not None and f.step > steps:
            raise SpikeError(f"--inject {f}: step {f.step} is after the run's last step "
                             f"({steps}); inject at a step from 1 to {steps}")
        seen.add((f.kind, f.step))
    return faults


class FaultLog:
    """Which injected faults have fired. With a `path` (beside the checkpoints) the record
    outlives the process: it is written, and synced, before a fault acts, so a run
    restarted after `crash@STEP` does not crash at STEP again."""

    def __init__(self, faults, path: Path | None = None, write: bool = True,
                 resumed_from: int = 0):
        self.faults, self.path, self.write = tuple(faults), path, write
        self.fired: set[str] = set()
        if path is not None and path.exists():
            self.fired = set(json.loads(path.read_text())["fired"])
        # an lr fault acts on state a checkpoint keeps (the guard's factor): resumed from a
        # step before it, the run's factor is the one before the jump, so it fires again
        self.fired -= {str(f) for f in self.faults if f.kind == "lr" and f.step > resumed_from}

    def due(self, step: int) -> list[Fault]:
        """The faults of `step` that have not fired yet, each recorded as fired now."""
        due = [f for f in self.faults if f.step == step and str(f) not in self.fired]
        if due:
            self.fired.update(map(str, due))
            if self.path is not None and self.write:  # several processes: process 0 writes
                self._write()
        return due

    def _write(self) -> None:
        write_text_atomically(self.path, json.dumps({"fired": sorted(self.fired)}),
                              durable=True)


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
