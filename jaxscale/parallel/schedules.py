"""Pipeline schedules as data, and an event-driven simulator that measures their bubble.

A pipeline cuts the model's layers into p stages, one per device, and the batch into m
micro-batches. For every micro-batch each device runs a forward (F) and, later, a backward
of its stage: one action (B), or two when the schedule splits it (B for the input gradient,
W for the weights: jaxscale.parallel.actions). A *schedule* is only the order in which each
device runs those actions:

  gpipe        all m forwards, then all m backwards (Huang et al. 2019).
  1f1b         PipeDream-flush (Narayanan et al. 2021): device s runs min(p-s-1, m) warm-up
               forwards, then alternates one forward and one backward, then drains the
               backwards left. Same bubble as GPipe, but at most p micro-batches hold
               activations at once instead of m.
  interleaved  Megatron-LM's interleaved 1F1B: each device holds v model chunks, the
               virtual stages s, s+p, ..., s+(v-1)p, so the pipeline has v*p stages, each
               1/v as long, and the bubble shrinks v-fold: (p-1)/(v*m+p-1).
  zb-h1, zb-h2 the zero-bubble schedules of Qi et al. 2023 (jaxscale.parallel.zero_bubble):
               1F1B with the backward split, the weight gradients moved into the gaps;
  zbv          and ZB-V: two chunks per device placed in a V (actions.place).

`simulate` runs each device's order strictly in sequence: an action starts once its device
has finished the previous one and its dependencies are done. Nothing is left to choose, so
this is what an event-driven simulation, or a real executor with blocking send/receive
between neighbouring stages, does; an order that would deadlock is refused. Communication
is free here: the bubble comes from the dependencies alone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property
from itertools import accumulate

from jaxscale.costmodel.schedule import least_micro_batches
from jaxscale.parallel import zero_bubble
from jaxscale.parallel.actions import Action, ScheduleError, check_counts, dependencies

SCHEDULES = ("gpipe", "1f1b", "interleaved", *zero_bubble.ZERO_BUBBLE)
SPLIT = zero_bubble.ZERO_BUBBLE  # the schedules whose backward is two actions, B and W
VEE = zero_bubble.VEE  # the schedules whose chunks are placed in a V
MAX_CHART_COLUMNS = 5000


def _exact(value) -> Fraction:
    """A number as an exact Fraction; a float means its decimal text (0.1 is 1/10)."""
    return Fraction(repr(value)) if isinstance(value, float) else Fraction(value)


def check_sizes(schedule: str, p: int, m: int, v: int = 1) -> None:
    """Raise ScheduleError unless `schedule` can run p stages, m micro-batches, v chunks."""
    if schedule not in SCHEDULES:
        raise ScheduleError(f"unknown pipeline schedule {schedule!r}; choose from "
                            f"{', '.join(SCHEDULES)}")
    check_counts(p, m, v)
    chunks = {"interleaved": None, "zbv": 2}.get(schedule, 1)  # None: any v >= 2
    if chunks is not None and v != chunks:
        raise ScheduleError(f"{schedule} runs {'two chunks' if chunks == 2 else 'one chunk'} "
                            f"per device, got v={v}; use "
                            + ("v=2" if chunks == 2 else "the interleaved schedule for v > 1"))
    least = least_micro_batches(schedule, p)  # a zero-bubble warm-up's forwards
    if m < least:
        raise ScheduleError(f"{schedule} needs at least {least} micro-batches with p={p} "
                            f"stages (its warm-up fills the pipeline), got m={m}; try m={least}")
    if schedule == "interleaved":
        if v < 2:
            raise ScheduleError("interleaved needs v >= 2 model chunks per device, got v=1 "
                                "(with one chunk per device use 1f1b)")
        if m % p:
            raise ScheduleError(f"interleaved needs the micro-batches m to be a multiple of the "
                                f"stages p (as in Megatron-LM), got m={m}, p={p}; try "
                                f"m={m + p - m % p}")


def stage_orders(schedule: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """For each of the p devices, the order in which it runs its forwards and backwards.

    Every device runs F and B (and W, if split) once for each (micro-batch, chunk), and
    running each list in sequence with blocking transfers between stages never deadlocks
    (`simulate` checks).
    """
    check_sizes(schedule, p, m, v)
    if schedule in SPLIT:  # zbv: its own placement, two chunks
        return [zero_bubble.device_order(schedule, s, p, m) for s in range(p)]
    orders = []
    for s in range(p):
        if schedule == "gpipe":
            orders.append([Action(kind, j, 0, s) for kind in "FB" for j in range(m)])
        else:
            # 1f1b: the last stage runs its first backward right after its first forward;
            # stage s first fills the p-s-1 stages behind it. Interleaved: Megatron-LM's
            # count, v-1 rounds of p forwards on the earlier chunks plus 2(p-s-1).
            warmup = p - s - 1 if schedule == "1f1b" else 2 * (p - s - 1) + (v - 1) * p
            orders.append(_one_forward_one_backward(s, p, m, v, min(warmup, m * v)))
    return orders


def _one_forward_one_backward(s: int, p: int, m: int, v: int, warmup: int) -> list[Action]:
    """Warm-up forwards, then alternate F and B, then the remaining backwards."""

    def nth(k: int, kind: str) -> Action:
        # Work comes in groups of p micro-batches: chunk 0 for all of them, then chunk 1,
        # ... Forwards visit the chunks first to last, backwards last to first.
        group, i = divmod(k, p * v)
        chunk = i // p if kind == "F" else v - 1 - i // p
        return Action(kind, group * p + i % p, chunk, s)

    total = m * v
    order = [nth(k, "F") for k in range(warmup)]
    for k in range(total - warmup):
        order += [nth(warmup + k, "F"), nth(k, "B")]
    return order + [nth(k, "B") for k in range(total - warmup, total)]


@dataclass(frozen=True)
class Timeline:
    """What each device ran and when: rows[s] is a list of (start, end, Action); times exact."""

    p: int
    m: int
    v: int
    rows: list[list[tuple[Fraction, Fraction, Action]]]
    vee: bool = False  # the chunks' placement (actions.place)

    @cached_property  # the charts read it often; exact arithmetic on every action is slow
    def makespan(self) -> Fraction:
        """Time from the first forward to the last backward."""
        return max(end for row in self.rows for _, end, _ in row)

    @cached_property
    def busy(self) -> list[Fraction]:
        """Per device, the time spent computing."""
        return [sum((end - start for start, end, _ in row), Fraction(0)) for row in self.rows]

    @property
    def idle_fraction(self) -> Fraction:
        """The bubble: total idle time / (p x makespan)."""
        return 1 - sum(self.busy) / (self.p * self.makespan)

    @property
    def split(self) -> bool:
        """Whether the backward ran as two actions, B and W."""
        return any(a.kind == "W" for row in self.rows for _, _, a in row)

    @property
    def peak_in_flight(self) -> list[int]:
        """Per device, the most micro-batches whose forward is done and whose backward is
        not (with the backward split: whose W is not): activations held.

        With v > 1 this counts chunk activations, each 1/v of the device's layers.
        """
        freed = "W" if self.split else "B"
        return [max(accumulate(1 if a.kind == "F" else -(a.kind == freed) for _, _, a in row),
                    default=0) for row in self.rows]


def action_costs(f_cost=1.0, b_cost=2.0, w_cost=None, v: int = 1,
                 split: bool = False) -> dict[str, Fraction]:
    """Each action's time, exact: f_cost and b_cost are a whole stage's forward and backward
    (a chunk takes 1/v of them); a split backward is B = b_cost - w_cost and W = w_cost
    (default: half the backward each)."""
    f, b = _exact(f_cost), _exact(b_cost)
    w = b / 2 if w_cost is None else _exact(w_cost)
    if f <= 0 or b <= 0 or (split and not 0 < w < b):
        raise ScheduleError(f"costs must be positive, got forward {f_cost}, backward {b_cost}"
                            + (f", weight part {w_cost} (it must be less than the backward)"
                               if split else ""))
    cost = {"F": f, "B": b - w, "W": w} if split else {"F": f, "B": b}
    return {k: c / v for k, c in cost.items()}


def simulate(orders: list[list[Action]], p: int, m: int, v: int = 1,
             f_cost=1.0, b_cost=2.0, w_cost=None, vee: bool = False) -> Timeline:
    """Run each device's order: an action starts when its device is free and its inputs are.

    Costs as `action_costs` says (the orders split the backward if they hold any W); the
    chunks placed in a V if `vee` (actions.place).
    Raises ScheduleError if an order misses or repeats work, or would deadlock.
    """
    check_counts(p, m, v)
    split = any(a.kind == "W" for order in orders for a in order)
    cost = action_costs(f_cost, b_cost, w_cost, v, split)
    if len(orders) != p:
        raise ScheduleError(f"need one order per device: {p} devices, got {len(orders)} orders")
    for s, order in enumerate(orders):
        want = sorted(Action(k, j, c, s) for k in cost for j in range(m) for c in range(v))
        if sorted(order) != want:
            raise ScheduleError(f"device {s} must run {' and '.join(cost)} exactly once for "
                                f"each of the {m} micro-batches on each of its {v} chunks")
    end: dict[Action, Fraction] = {}  # finish time of every action run so far
    # per device: what it ran, when it is free, the index of its next action
    rows, free, nxt = [[] for _ in range(p)], [Fraction(0)] * p, [0] * p
    while len(end) < len(cost) * m * v * p:
        progressed = False
        for s in range(p):  # run each device as far as its inputs allow
            while nxt[s] < len(orders[s]):
                a = orders[s][nxt[s]]
                deps = dependencies(a, p, v, vee)
                if any(d not in end for d in deps):
                    break  # an input is not computed yet: try the other devices
                start = max([free[s]] + [end[d] for d in deps])
                end[a] = free[s] = start + cost[a.kind]
                rows[s].append((start, end[a], a))
                nxt[s], progressed = nxt[s] + 1, True
        if not progressed:
            stuck = ", ".join(f"device {s} at {orders[s][nxt[s]].label(v)}"
                              for s in range(p) if nxt[s] < len(orders[s]))
            raise ScheduleError(f"the orders deadlock: every device waits ({stuck})")
    return Timeline(p, m, v, rows, vee)


def bubble_over_total(schedule: str, p: int, m: int, v: int = 1, f_cost=1.0, b_cost=2.0,
                      w_cost=None) -> Fraction | None:
    """The textbook idle fraction, idle over the whole time: (p-1)/(m+p-1), and
    (p-1)/(v*m+p-1) when interleaved, whatever the costs; for the zero-bubble schedules,
    zero_bubble.idle_per_device over it plus the work, which depends on the costs (None
    where there is no closed form: zbv unless F = B = W). Exact, to compare with the
    simulated timeline. The float twin for any sizes is jaxscale.costmodel.bubble_over_total;
    Narayanan et al.'s bubble over ideal time is jaxscale.costmodel.bubble_over_ideal."""
    check_sizes(schedule, p, m, v)
    if schedule not in SPLIT:
        return Fraction(p - 1, v * m + p - 1)
    c = action_costs(f_cost, b_cost, w_cost, v, split=True)
    idle = zero_bubble.idle_per_device(schedule, p, c["F"], c["B"], c["W"])
    return None if idle is None else idle / (idle + m * v * sum(c.values()))


def run(schedule: str, p: int, m: int, v: int = 1, f_cost=1.0, b_cost=2.0,
        w_cost=None) -> Timeline:
    """stage_orders then simulate: the timeline of one named schedule."""
    return simulate(stage_orders(schedule, p, m, v), p, m, v, f_cost, b_cost, w_cost,
                    schedule in VEE)


def smallest_micro_batches(schedule: str, p: int, max_idle=0.10, v: int = 1,
                           f_cost=1.0, b_cost=2.0, limit: int = 4096, w_cost=None) -> int:
    """The fewest micro-batches whose simulated idle fraction is <= max_idle (exercise 3).

    Asks the simulator, never the formula. Idle falls as m grows (fill and drain stay, work
    grows), so m doubles until the bound holds, then bisection finds the m (a multiple of p
    if interleaved; from its warm-up's least for a zero-bubble schedule) that meets it
    while the one below, also simulated, does not.
    """
    step = p if schedule == "interleaved" else 1
    first = least_micro_batches(schedule, p) if schedule in SPLIT else step
    check_sizes(schedule, p, first, v)
    bound = _exact(max_idle)

    def m_of(k: int) -> int:  # k = 1 is the least m
        return first + (k - 1) * step

    def meets(k: int) -> bool:
        return run(schedule, p, m_of(k), v, f_cost, b_cost, w_cost).idle_fraction <= bound

    hi = 1
    while not meets(hi):
        if m_of(hi) >= limit:
            raise ScheduleError(f"no m <= {limit} brings {schedule} with p={p} to idle "
                                f"<= {max_idle}")
        hi *= 2
    lo = hi // 2  # fails (or is below the least)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if meets(mid) else (mid, hi)
    return m_of(hi)


def time_unit(timeline: Timeline) -> Fraction:
    """The largest time step every start and end is a whole multiple of: a chart column."""
    times = {t for row in timeline.rows for start, end, _ in row for t in (start, end)}
    den = math.lcm(*(t.denominator for t in times))
    return Fraction(math.gcd(*(int(t * den) for t in times)), den)


def text_chart(timeline: Timeline) -> str:
    """One row per device, one column per time unit: F3/B3 for micro-batch 3, '.' idle.

    With v > 1 chunks the label ends in the chunk's letter (a = first chunk). A cell is
    as wide as the longest label, so the columns of all rows line up.
    """
    unit = time_unit(timeline)
    columns = timeline.makespan / unit
    if columns > MAX_CHART_COLUMNS:
        raise ScheduleError(f"the chart would be {int(columns):,} columns wide, more than "
                            f"{MAX_CHART_COLUMNS:,}: use fewer micro-batches or chunks, or "
                            "costs on a coarser grid (e.g. whole numbers)")
    width = len(Action("F", timeline.m - 1, timeline.v - 1, 0).label(timeline.v))
    lines = []
    for s, row in enumerate(timeline.rows):
        cells = [".".ljust(width)] * int(columns)
        for start, end, a in row:
            for col in range(int(start / unit), int(end / unit)):
                cells[col] = a.label(timeline.v).ljust(width)
        lines.append(f"device {s:<{len(str(timeline.p - 1))}} |{''.join(cells)}|")
    return "\n".join(lines)
