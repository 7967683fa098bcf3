"""The words every pipeline schedule is written in: actions, and what each one waits for.

A pipeline cuts the model's layers into stages and the batch into m micro-batches. Each
device runs, for every micro-batch and every model chunk it holds, a few actions:

  F  the forward of its stage;
  B  the backward: the whole of it (gradients of the stage's input and of its weights),
     or, in a schedule that splits it (the zero-bubble ones), the input gradient only:
     the part the previous stage waits for;
  W  the weight gradient of a split backward: nothing waits for it but the optimizer, so
     a schedule may put it wherever a device would otherwise be idle.

The model's layers are cut into V = v * p virtual stages, v chunks per device. Where each
one lives is the placement: "loop" (Megatron's interleaving) puts virtual stage k on device
k mod p as chunk k // p, so the pipeline loops through the devices v times; "vee" (ZB-V,
two chunks) runs down the devices and back up: device s holds stages s and 2p-1-s, so the
first and the last stage, the embedding and the loss, are both on device 0.

Dependencies, for micro-batch j and virtual stage k:
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

    def virtual_stage(self, p: int, vee: bool = False) -> int:
        """Position of this chunk in the whole pipeline of v*p virtual stages (placement
        "vee" if `vee`, else "loop": module docstring)."""
        if vee:
            return self.stage if self.chunk == 0 else 2 * p - 1 - self.stage
        return self.chunk * p + self.stage

    def label(self, v: int = 1) -> str:
        """Short name: F3 for micro-batch 3's forward; with v > 1 chunks, F3a, F3b, ..."""
        return f"{self.kind}{self.micro_batch}" + (chr(ord("a") + self.chunk) if v > 1 else "")


def check_counts(p, m, v) -> None:
    """Raise ScheduleError unless p, m and v are positive integers (not bools)."""
    for name, value in (("stages p", p), ("micro-batches m", m), ("virtual chunks v", v)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"{name} must be a positive integer, got {value!r}")


def place(k: int, p: int, vee: bool = False) -> tuple[int, int]:
    """(device, chunk) of virtual stage k (placement "vee" if `vee`, else "loop")."""
    if vee:
        return (k, 0) if k < p else (2 * p - 1 - k, 1)
    return k % p, k // p


def dependencies(action: Action, p: int, v: int, vee: bool = False) -> list[Action]:
    """The actions (on any device) that must finish before `action` can start."""
    k, last, j = action.virtual_stage(p, vee), v * p - 1, action.micro_batch

    def at(kind: str, stage: int) -> Action:
        device, chunk = place(stage, p, vee)
        return Action(kind, j, chunk, device)

    if action.kind == "F":
        return [] if k == 0 else [at("F", k - 1)]
    if action.kind == "W":
        return [Action("B", j, action.chunk, action.stage)]
    return [at("F", k)] if k == last else [at("B", k + 1)]
