"""A pipeline schedule compiled into lockstep tables, for the executor (parallel.pipeline).

`tick_table` runs the schedule in the simulator with unit costs, so every action takes one
tick, and turns it into tables [ticks, p]: what each device does at each tick, and in which
buffer slot each arriving activation or gradient waits until it is used. Slots are reused
as soon as they are free: GPipe needs m, 1F1B at most p. A schedule that splits the backward
(zero-bubble) also says in which slot B's results wait for W.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxscale.parallel import schedules as sched

IDLE, FORWARD, BACKWARD, WEIGHT = 0, 1, 2, 3
KIND_CODE = {"F": FORWARD, "B": BACKWARD, "W": WEIGHT}


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
    split = schedule in sched.SPLIT  # then B and W each take one tick, as F does
    timeline = sched.run(schedule, p, m, v, f_cost=v, b_cost=(2 if split else 1) * v,
                         w_cost=v if split else None)  # a chunk's action: one tick
    n_virtual = p * v
    when = {(a.kind, a.micro_batch, a.virtual_stage(p)): int(start)
            for row in timeline.rows for start, _, a in row}
    ticks = int(timeline.makespan)
    assert all(start.denominator == 1 for row in timeline.rows for start, _, _ in row)
    tables = {k: np.zeros((ticks, p), np.int32) for k in ("kind", "micro", "chunk", "slot",
                                                          "gslot", "wslot")}
    recv, grecv = np.full((ticks, p), -1, np.int32), np.full((ticks, p), -1, np.int32)
    acts, grads, held = [{} for _ in range(p)], [{} for _ in range(p)], [{} for _ in range(p)]
    for (kind, j, k), t in when.items():
        if kind == "F" and k > 0:  # its input arrives at the end of F(j, k-1)'s tick
            acts[k % p][(j, k)] = (when["F", j, k - 1], when["B", j, k])
        if kind == "B" and k < n_virtual - 1:  # its gradient arrives after B(j, k+1)
            grads[k % p][(j, k)] = (when["B", j, k + 1], t)
        if kind == "W":  # B's results wait for it on the same device
            held[k % p][(j, k)] = (when["B", j, k], t)
    slot_maps, gslot_maps = [_assign(a) for a in acts], [_assign(g) for g in grads]
    wslot_maps = [_assign(h) for h in held]
    for (kind, j, k), t in when.items():
        s = k % p
        tables["kind"][t, s] = KIND_CODE[kind]
        tables["micro"][t, s], tables["chunk"][t, s] = j, k // p
        tables["slot"][t, s] = slot_maps[s][0].get((j, k), 0)  # stage 0: input unused
        tables["gslot"][t, s] = gslot_maps[s][0].get((j, k), 0)  # last stage: unused
        tables["wslot"][t, s] = wslot_maps[s][0].get((j, k), 0)
        if kind == "F" and k + 1 < n_virtual:
            recv[t, (k + 1) % p] = slot_maps[(k + 1) % p][0][(j, k + 1)]
        if kind == "B" and k > 0:
            grecv[t, (k - 1) % p] = gslot_maps[(k - 1) % p][0][(j, k - 1)]
    wslot = tables.pop("wslot")
    return TickTable(**tables, recv=recv, grecv=grecv,
                     slots=max(1, max(n for _, n in slot_maps)),
                     gslots=max(1, max(n for _, n in gslot_maps)),
                     **({"wslot": wslot, "wslots": max(n for _, n in wslot_maps)}
                        if split else {}))
