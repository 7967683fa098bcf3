"""Zero-bubble schedules (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"), as data.

1F1B's bubble comes from its backward: the previous stage waits for the input gradient
only, yet each backward also computes the weight gradient before passing anything on. Split
the backward into B (input gradient, on the critical path) and W (weight gradient, needed
only by the optimizer) and the Ws can be moved into the gaps. With F, B and W the forward,
input-gradient and weight-gradient times of one stage, device s (0-based) runs:

  zb-h1  p-s-1 forwards; then s pairs (F, B) whose Ws wait; then (F, B, W) while forwards
         remain; then (B, W); then the waiting Ws. At most p micro-batches hold activations
         on any device (from F to W), 1F1B's peak, and the idle time per device falls from
         1F1B's (p-1)(F+B+W) to (p-1) max(F, F+B-W): a third of it when F = B = W.
  zb-h2  2(p-s)-1 forwards (enough to cover the time until the first B comes back), then 2s
         pairs (F, B) with their Ws put off to the end, then as zb-h1. Up to 2p micro-batches
         in flight per device; idle (p-1) max(F, F+B-2W) once m >= 2p (fewer are refused).

Why zb-h2 is not zero here: Qi et al.'s zero for ZB-H2 lets the next step's forwards start
on device 0 while the last devices still finish this one (their optimizer step validates
after the fact). Inside one step, which ends with one optimizer update after every gradient
(what jaxscale runs: gradient clipping reads the global norm first), the last device cannot
start before the first micro-batch's forward reaches it, (p-1)F, and then has m(F+B+W) of
work: no device can idle less than (p-1)F. zb-h2 reaches that floor whenever 2W >= B,
zb-h1 whenever W >= B.
"""
from __future__ import annotations

from fractions import Fraction

from jaxscale.parallel.actions import Action

ZERO_BUBBLE = ("zb-h1", "zb-h2")


def device_order(schedule: str, s: int, p: int, m: int) -> list[Action]:
    """Device s's order of every F, B and W (module docstring), for m micro-batches."""
    warmup, deferred = (p - s - 1, s) if schedule == "zb-h1" else (2 * (p - s) - 1, 2 * s)
    order, f, b, w = [], 0, 0, 0

    def act(kind: str, j: int) -> Action:
        return Action(kind, j, 0, s)

    for _ in range(min(warmup, m)):
        order.append(act("F", f))
        f += 1
    for _ in range(min(deferred, m - f)):  # F, B: the W waits for a gap
        order += [act("F", f), act("B", b)]
        f, b = f + 1, b + 1
    while f < m:  # the steady state: one of each
        order += [act("F", f), act("B", b), act("W", w)]
        f, b, w = f + 1, b + 1, w + 1
    while b < m:  # the drain: the remaining input gradients, each with its weights
        order += [act("B", b), act("W", w)]
        b, w = b + 1, w + 1
    return order + [act("W", j) for j in range(w, m)]


def idle_per_device(schedule: str, p: int, f, b, w) -> Fraction:
    """The closed form of each device's idle time within one step (module docstring),
    exact for the costs given as Fractions."""
    return (p - 1) * max(f, f + b - (w if schedule == "zb-h1" else 2 * w))


def synchronous_floor(p: int, f) -> Fraction:
    """The least idle time per device of any schedule of one step: (p-1) F."""
    return (p - 1) * f
