"""The words every pipeline schedule is written in: actions, and what each one waits for.

A pipeline cuts the model's layers into stages and the batch into m micro-batches. Each
device runs, for every micro-batch and every model chunk it holds, a few actions:

  F  the forward of its stage;
  B  the backward: the whole of it (gradients of the stage's input and of its weights),
     or, in a schedule that splits it (the zero-bubble ones), the input gradient only:
     the part the previous stage waits for;
  W  the weight gradient of a split backward: nothing waits for it but the optimizer, so
     a schedule may put it wherever a device would otherwise be idle.

Dependencies, with virtual stage k = chunk * p + device and V = v * p virtual stages:
    F(j, k) needs F(j, k-1);   B(j, k) needs B(j, k+1);   B(j, V-1) needs F(j, V-1);
    W(j, k) needs B(j, k) (same device: the gradient at the stage's output that B computed).
"""
from __future__ import annotations

from dataclasses import dataclass

KINDS = ("F", "B", "W")


class ScheduleError(ValueError):
    """A schedule name, size or order that cannot run; the message says what would."""


@dataclass(frozen=True, order=True)
class Action:
    """One unit of pipeline work: kind F, B or W of micro-batch j on chunk c of device s."""

    kind: str
    micro_batch: int
    chunk: int
    stage: int  # the device (pipeline rank); its virtual stage is chunk * p + stage

    def virtual_stage(self, p: int) -> int:
        """Position of this chunk in the whole pipeline of v*p virtual stages."""
        return self.chunk * p + self.stage

    def label(self, v: int = 1) -> str:
        """Short name: F3 for micro-batch 3's forward; with v > 1 chunks, F3a, F3b, ..."""
        return f"{self.kind}{self.micro_batch}" + (chr(ord("a") + self.chunk) if v > 1 else "")


def check_counts(p, m, v) -> None:
    """Raise ScheduleError unless p, m and v are positive integers (not bools)."""
    for name, value in (("stages p", p), ("micro-batches m", m), ("virtual chunks v", v)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"{name} must be a positive integer, got {value!r}")


def dependencies(action: Action, p: int, v: int) -> list[Action]:
    """The actions (on any device) that must finish before `action` can start."""
    k, last, j = action.virtual_stage(p), v * p - 1, action.micro_batch
    if action.kind == "F":
        return [] if k == 0 else [Action("F", j, (k - 1) // p, (k - 1) % p)]
    if action.kind == "W":
        return [Action("B", j, action.chunk, action.stage)]
    if k == last:
        return [Action("F", j, action.chunk, action.stage)]
    return [Action("B", j, (k + 1) // p, (k + 1) % p)]
