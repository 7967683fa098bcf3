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
         pairs (F, B) whose Ws wait for the drain, then as zb-h1. Up to 2p micro-batches
         in flight per device; idle (p-1) max(F, F+B-2W) once m >= 2p (fewer are refused).
  zbv    two chunks per device in a V (device s holds virtual stages s and 2p-1-s: the
         activations run down the devices and back up, so the loss is on device 0 and the
         turn at device p-1 needs no transfer), each chunk half a stage. Device s runs
         2(p-s)-1 forwards of its first chunk; s pairs (F second chunk, F first chunk);
         p-s triples (F, B, W) of its second chunk; then, while forwards remain, (F, B, W)
         of the first chunk and (F, B, W) of the second; the drain: s pairs of input
         gradients (first chunk, second), p-s pairs (B, W) of the first chunk, then the
         waiting Ws, second chunk first. This is the ZB-V of Qi et al. as PyTorch's
         ScheduleZBVZeroBubble (torchtitan's ZBVZeroBubble) lays it out; it needs
         m >= 2p-1. At most 2p chunk activations, p stages' worth, are in flight per device
         (1F1B's first stage), and with F = B = W each device idles (p-1)F/2: the last
         device's first chunk starts half a stage after the previous one's.

Why zb-h2 is not zero here: Qi et al.'s zero for ZB-H2 lets the next step's forwards start
on device 0 while the last devices still finish this one (their optimizer step validates
after the fact). Inside one step, which ends with one optimizer update after every gradient
(what jaxscale runs: gradient clipping reads the global norm first), the last device cannot
start before the first micro-batch's forward reaches it, (p-1)F, and then has m(F+B+W) of
work: with one whole stage per device, no device can idle less than (p-1)F. zb-h2 reaches
that floor whenever 2W >= B, zb-h1 whenever W >= B; zbv, whose chunks are half a stage,
goes below it.
"""
from __future__ import annotations

from fractions import Fraction

from jaxscale.parallel.actions import Action

ZERO_BUBBLE = ("zb-h1", "zb-h2", "zbv")
VEE = ("zbv",)  # the schedules whose chunks are placed in a V (actions.place)


def device_order(schedule: str, s: int, p: int, m: int) -> list[Action]:
    """Device s's order of every F, B and W (module docstring), for m micro-batches."""
    if schedule == "zbv":
        return _vee_order(s, p, m)
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


def _vee_order(s: int, p: int, m: int) -> list[Action]:
    """zbv's order for device s (module docstring); chunk 0 runs down, chunk 1 back up."""
    order, done = [], {(kind, c): 0 for kind in "FBW" for c in (0, 1)}

    def run(*steps: tuple[str, int]) -> None:
        for kind, chunk in steps:
            order.append(Action(kind, done[kind, chunk], chunk, s))
            done[kind, chunk] += 1

    for _ in range(2 * (p - s) - 1):
        run(("F", 0))
    for _ in range(s):
        run(("F", 1), ("F", 0))
    for _ in range(p - s):
        run(("F", 1), ("B", 1), ("W", 1))
    while done["F", 1] < done["F", 0] or done["F", 0] < m:
        run(*([("F", 0)] if done["F", 0] < m else []), ("B", 0), ("W", 0),
            ("F", 1), ("B", 1), ("W", 1))
    for _ in range(s):
        run(("B", 0), ("B", 1))
    for _ in range(p - s):
        run(("B", 0), ("W", 0))
    run(*[("W", 1)] * (done["B", 1] - done["W", 1]), *[("W", 0)] * (done["B", 0] - done["W", 0]))
    return order


def idle_per_device(schedule: str, p: int, f, b, w) -> Fraction | None:
    """The closed form of each device's idle time within one step (module docstring), from
    one chunk's F, B and W: exact for Fractions. zbv has one only when F = B = W (the
    paper's assumption): None otherwise; the simulator measures it."""
    if schedule == "zbv":
        return (p - 1) * f if f == b == w else None
    return (p - 1) * max(f, f + b - (w if schedule == "zb-h1" else 2 * w))


def synchronous_floor(p: int, f) -> Fraction:
    """The least idle time per device of any schedule of one step with one whole stage per
    device: (p-1) F (module docstring)."""
    return (p - 1) * f
