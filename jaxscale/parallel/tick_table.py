"""A pipeline schedule compiled into lockstep tables, for the executor (parallel.pipeline).

`tick_table` runs the schedule in the simulator with unit costs, so every action takes one
tick, and turns it into tables [ticks, p]: what each device does at each tick, and in which
buffer slot each arriving activation or gradient waits until it is used. Slots are reused
as soon as they are free: GPipe needs m, 1F1B at most p. A schedule that splits the backward
(zero-bubble) also says in which slot B's results wait for W. When the chunks sit in a V
(zbv) a device can receive from both neighbours and from itself in one tick: activations
come from the previous device (recv) on the way down, from the next (recv2) on the way up
and from itself (keep) at the turn; gradients the other way round (grecv from the next,
grecv2 from the previous, gkeep from itself).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxscale.parallel import schedules as sched
from jaxscale.parallel.actions import place

IDLE, FORWARD, BACKWARD, WEIGHT = 0, 1, 2, 3
KIND_CODE = {"F": FORWARD, "B": BACKWARD, "W": WEIGHT}
ARRIVALS = ("recv", "grecv", "recv2", "grecv2", "keep", "gkeep")


@dataclass(frozen=True)
class TickTable:
    """A schedule as lockstep ticks; every array is [ticks, p] (device s reads column s)."""

    kind: np.ndarray  # IDLE, FORWARD, BACKWARD or (a split backward's weights) WEIGHT
    micro: np.ndarray  # micro-batch of the action
    chunk: np.ndarray  # chunk (virtual stage = chunk * p + device)
    slot: np.ndarray  # activation slot the action reads (its stage input)
    gslot: np.ndarray  # gradient slot a BACKWARD reads
    recv: np.ndarray  # activation slot an arriving activation is written to, -1 if none
    grecv: np.ndarray  # gradient slot an arriving gradient is written to, -1 if none
    slots: int
    gslots: int
    wslot: np.ndarray | None = None  # split backward: the slot B's results wait in for W
    wslots: int = 0
    recv2: np.ndarray | None = None  # chunks in a V: the other neighbour's arrivals, and
    grecv2: np.ndarray | None = None  # the device's own (module docstring); -1 if none
    keep: np.ndarray | None = None
    gkeep: np.ndarray | None = None

    @property
    def vee(self) -> bool:
        """Whether the chunks sit in a V (zbv): arrivals come from either neighbour."""
        return self.keep is not None

    @property
    def split(self) -> bool:
        """Whether the backward runs as two actions, B and W (zero-bubble schedules)."""
        return self.wslot is not None

    @property
    def ticks(self) -> int:
        return self.kind.shape[0]

    def branch_share(self) -> dict[int, float]:
        """Share of ticks a device spends idle, in F, in B (and W) (the same on every device:
        each runs every micro-batch's actions once per chunk), i.e. how often each branch of
        the executor's lax.switch runs, for measure.collectives."""
        kinds = (IDLE, FORWARD, BACKWARD, WEIGHT) if self.split else (IDLE, FORWARD, BACKWARD)
        return {k: float(np.mean(self.kind[:, 0] == k)) for k in kinds}


def plan_branch_share(plan) -> dict[int, float] | None:
    """How often each branch of a plan's pipeline tick switch runs (TickTable.branch_share),
    for measure.collectives, which cannot tell from the HLO; None without a pipeline."""
    if plan.pp == 1:
        return None
    return tick_table(plan.schedule, plan.pp, plan.micro_batches, plan.virtual).branch_share()

def _assign(intervals: dict) -> tuple[dict, int]:
    """Slots for (key -> (write tick, read tick)) intervals on one device; a slot is free
    again from the tick it was last read (reads happen before that tick's writes)."""
    free_at, slot_of = [], {}
    for key, (start, end) in sorted(intervals.items(), key=lambda kv: kv[1]):
        for i, t in enumerate(free_at):
            if t <= start:
                free_at[i], slot_of[key] = end, i
                break
        else:
            free_at.append(end)
            slot_of[key] = len(free_at) - 1
    return slot_of, len(free_at)


def tick_table(schedule: str, p: int, m: int, v: int = 1) -> TickTable:
    """Compile `schedule` for p devices, m micro-batches, v chunks into lockstep tables."""
    split, vee = schedule in sched.SPLIT, schedule in sched.VEE  # split: B, W one tick each
    timeline = sched.run(schedule, p, m, v, f_cost=v, b_cost=(2 if split else 1) * v,
                         w_cost=v if split else None)  # a chunk's action: one tick
    n_virtual = p * v
    when = {(a.kind, a.micro_batch, a.virtual_stage(p, vee)): int(start)
            for row in timeline.rows for start, _, a in row}
    ticks = int(timeline.makespan)
    assert all(start.denominator == 1 for row in timeline.rows for start, _, _ in row)
    tables = {k: np.zeros((ticks, p), np.int32) for k in ("kind", "micro", "chunk", "slot",
                                                          "gslot", "wslot")}
    arrivals = {k: np.full((ticks, p), -1, np.int32) for k in ARRIVALS}
    device = {k: place(k, p, vee)[0] for k in range(n_virtual)}
    acts, grads, held = [{} for _ in range(p)], [{} for _ in range(p)], [{} for _ in range(p)]
    for (kind, j, k), t in when.items():
        if kind == "F" and k > 0:  # its input arrives at the end of F(j, k-1)'s tick
            acts[device[k]][(j, k)] = (when["F", j, k - 1], when["B", j, k])
        if kind == "B" and k < n_virtual - 1:  # its gradient arrives after B(j, k+1)
            grads[device[k]][(j, k)] = (when["B", j, k + 1], t)
        if kind == "W":  # B's results wait for it on the same device
            held[device[k]][(j, k)] = (when["B", j, k], t)
    slot_maps, gslot_maps = [_assign(a)[0] for a in acts], [_assign(g)[0] for g in grads]
    wslot_maps = [_assign(h)[0] for h in held]
    for (kind, j, k), t in when.items():
        s = device[k]
        tables["kind"][t, s] = KIND_CODE[kind]
        tables["micro"][t, s], tables["chunk"][t, s] = j, place(k, p, vee)[1]
        tables["slot"][t, s] = slot_maps[s].get((j, k), 0)  # stage 0: input unused
        tables["gslot"][t, s] = gslot_maps[s].get((j, k), 0)  # last stage: unused
        tables["wslot"][t, s] = wslot_maps[s].get((j, k), 0)
        to = k + 1 if kind == "F" else k - 1  # where its output goes
        if kind in "FB" and 0 <= to < n_virtual:
            maps = slot_maps if kind == "F" else gslot_maps
            channel = _channel(kind, s, device[to], p)
            assert arrivals[channel][t, device[to]] < 0, "two arrivals on one channel"
            arrivals[channel][t, device[to]] = maps[device[to]][(j, to)]
    return TickTable(**{k: tables[k] for k in ("kind", "micro", "chunk", "slot", "gslot")},
                     recv=arrivals["recv"], grecv=arrivals["grecv"],
                     slots=max(1, *(len(set(x.values())) for x in slot_maps)),
                     gslots=max(1, *(len(set(x.values())) for x in gslot_maps)),
                     **({"wslot": tables["wslot"],
                         "wslots": max(len(set(x.values())) for x in wslot_maps)}
                        if split else {}),
                     **({k: arrivals[k] for k in ARRIVALS[2:]} if vee else {}))


def _channel(kind: str, source: int, dest: int, p: int) -> str:
    """The table an arrival is written in (module docstring): an activation from the
    previous device (around the ring) is `recv`, a gradient from the next one `grecv`, as in
    every schedule; in a V also the other neighbour's (recv2, grecv2) and the device's own
    (keep, gkeep). With p = 2 both neighbours are one device, whose one output per tick
    takes the usual channel."""
    usual = (dest - 1) % p if kind == "F" else (dest + 1) % p
    if source == dest:
        return "keep" if kind == "F" else "gkeep"
    if source == usual:
        return "recv" if kind == "F" else "grecv"
    return "recv2" if kind == "F" else "grecv2"
