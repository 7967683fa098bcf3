"""The pipeline schedule in the cost model: its bubble, and what its first stage holds.

    schedule      bubble over ideal time    micro-batches the first stage holds at its peak
    gpipe         (p-1) / m                 m
    1f1b          (p-1) / m                 min(m, p)
    interleaved   (p-1) / (v m)             min(m, p) (1 + (p-1)/(p v))   Korthikanti eq. 5
    zb-h1         (p-1) / (3 m)             p       (m >= p; held from F until W)
    zb-h2         (p-1) / (3 m)             2 p     (m >= 2p)
    zbv           (p-1) / (6 m)             p       (v = 2 in a V, m >= 2p-1)

The zero-bubble rows (Qi et al. 2023) take F = B = W: a backward's input gradient and its
weight gradient each cost a forward's matmul FLOPs. Each device then idles (p-1)F, a third
of 1F1B's (p-1)(F+B+W); zbv's chunks are half a stage, so it idles half that. Qi et al.
give ZB-H2 zero bubble: that needs the next step's
forwards to start before this step's optimizer update, which a step with gradient clipping
(the global norm first) cannot do, so inside one step (p-1)F is the floor for every
schedule with one whole stage per device, and zb-h2 sits on it; jaxscale.parallel.zero_bubble measures both in the
simulator. Bubble over ideal time is Narayanan et al.'s definition (the time model adds
it x compute); over the whole time it is b / (1 + b).
"""
from __future__ import annotations

from jaxscale.costmodel.shape import ShapeError

SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1", "zb-h2", "zbv")
ZERO_BUBBLE = {"zb-h1": 1, "zb-h2": 1, "zbv": 2}  # each with this many chunks per device


def check(schedule: str, pp: int, micro_batches: int, virtual: int = 1) -> None:
    """Raise ShapeError for a size below 1 or an unknown schedule, naming it."""
    for name, v in (("pp", pp), ("micro_batches", micro_batches), ("virtual", virtual)):
        if not v >= 1:
            raise ShapeError(f"{name} must be >= 1, got {v}")
    if schedule not in SCHEDULES:
        raise ShapeError(f"unknown schedule {schedule!r}; choose from {', '.join(SCHEDULES)}")


def least_micro_batches(schedule: str, pp: int) -> int:
    """The fewest micro-batches the schedule runs with on pp stages (its warm-up's)."""
    return {"zb-h1": pp, "zb-h2": 2 * pp, "zbv": 2 * pp - 1}.get(schedule, 1) if pp > 1 else 1


def bubble_over_ideal(schedule: str, pp: int, micro_batches: int, virtual: int = 1) -> float:
    """Pipeline idle time over the bubble-free time (module docstring's table)."""
    check(schedule, pp, micro_batches, virtual)
    if micro_batches < least_micro_batches(schedule, pp):
        raise ShapeError(f"{schedule} needs at least {least_micro_batches(schedule, pp)} "
                         f"micro-batches with pp={pp}, got {micro_batches}")
    if schedule in ZERO_BUBBLE:
        return (pp - 1) / (3 * ZERO_BUBBLE[schedule] * micro_batches)
    return (pp - 1) / (virtual * micro_batches)


def in_flight(pp: int, micro_batches: int, schedule: str = "1f1b", virtual: int = 1) -> float:
    """Micro-batches' worth of a stage's activations the first stage holds at its peak
    (module docstring's table). pp = 1 is gradient accumulation: one at a time."""
    check(schedule, pp, micro_batches, virtual)
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(micro_batches)
    if schedule in ZERO_BUBBLE:
        return float(min(micro_batches, (2 if schedule == "zb-h2" else 1) * pp))
    held = float(min(micro_batches, pp))
    if schedule == "interleaved":
        held *= 1 + (pp - 1) / (pp * virtual)
    return held
