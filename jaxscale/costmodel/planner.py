"""Choose a layout for a model on a cluster: search, keep what fits, rank by predicted step time.

The rules (RULES says the same in words):

 1. Candidates: every devices = dp x tp x pp x cp, with v chunks per pipeline device
    (interleaved 1F1B) or one (1F1B), and the zero-bubble schedules when asked (zb-h1,
    zb-h2 with one chunk, zbv with two), ZeRO 0-3, recompute none / selective / full and
    micro-batch sizes 1, 2, 4, 8 (those dividing a replica's batch). Sequence parallelism
    is on whenever tp > 1: in this model it costs no time (the same bytes as tp's
    all-reduces) and saves memory.
 2. Structure: tp divides the node size (it is on the critical path of every layer) and the
    heads; pp x v divides the layers; cp divides the sequence; dp x micro-batch divides the
    batch; interleaving needs m divisible by pp (Megatron's rule); zb-h1 needs m >= p,
    zb-h2 m >= 2p, zbv m >= 2p-1 (and v = 2); ZeRO needs dp > 1.
 3. Memory (costmodel.layout.memory: states with the byte budget and ZeRO, the gathered
    layer, activations on the first stage) <= usable x device memory.
 4. Optional cap on the pipeline bubble (p-1)/(v m) (zero-bubble: (p-1)/(3m)), Narayanan
    et al.'s definition.
 5. Degrees the user fixes (`fixed`, e.g. dp = 1 as in Korthikanti et al.'s runs) narrow
    rule 1; they are not counted as rejections. `considered` and the rejections count
    meshes (dp, tp, pp, cp): a mesh is rejected when none of its options survives, for
    the latest rule its options broke (memory before batch before structure).
 6. Rank by predicted step time (costmodel.steptime), then by memory; the first is
    recommended.

The published layouts this is checked against are in jaxscale.costmodel.published
(tests/costmodel/test_planner.py, experiments/cost_model.py), the published shapes in
jaxscale.costmodel.references.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field

from jaxscale import costmodel as cm
from jaxscale.costmodel.devices import Device
from jaxscale.costmodel.layout import Layout, memory
from jaxscale.costmodel.schedule import ZERO_BUBBLE, least_micro_batches
from jaxscale.costmodel.shape import Transformer
from jaxscale.costmodel.steptime import step_time

RULES = [
    ("candidates: devices = dp x tp x pp x cp, v chunks per pipeline device (one: the "
     "schedules asked for, 1f1b by default), ZeRO 0-3, "
     "recompute none/selective/full, micro-batch 1/2/4/8; sequence parallelism whenever tp > 1; "
     "a mixture of experts: ep, a share of dp dividing the experts"),
    ("structure: tp divides the node size and the heads; pp x v divides the layers; cp divides "
     "the sequence; dp x micro-batch divides the batch; interleaving needs m % pp == 0; "
     "zero-bubble needs m >= p (zb-h1), 2p (zb-h2), 2p-1 (zbv); ZeRO needs dp > 1"),
    "memory per device (states, gathered layer, first-stage activations) <= usable x memory",
    "pipeline bubble (p-1)/(v m) (zero-bubble: (p-1)/(3m), zbv (p-1)/(6m)) <= max bubble, "
    "when a cap is given",
    "rank by predicted step time (compute, bubble, tp, pp, ep's all-to-alls, exposed cp and "
    "dp), then memory",
]

REASONS = {
    "tp": "tp does not divide the node size or the heads",
    "pp": "pp x v does not divide the layers",
    "cp": "cp does not divide the sequence",
    "batch": "dp x micro-batch does not divide the batch",
    "interleave": "interleaving needs micro-batches divisible by pp",
    "zero_bubble": "zero-bubble needs m >= p (zb-h1), 2p (zb-h2) or 2p-1 (zbv) micro-batches",
    "memory": "does not fit in memory",
    "bubble": "pipeline bubble above the cap",
}

MICRO_BATCHES = (1, 2, 4, 8)
FIXABLE = ("dp", "tp", "pp", "cp", "virtual", "zero", "micro_batch", "ep")
RECOMPUTE = ("none", "selective", "full")


def divisors(n: int) -> list[int]:
    """The divisors of n in increasing order (trial division up to sqrt(n))."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


@dataclass(frozen=True)
class Job:
    """The model, the step and the cluster: what the planner is asked about."""
    shape: Transformer
    batch: int  # global, in sequences
    devices: int
    device: Device
    usable: float = 0.9
    efficiency: float = 0.7
    budget: str = "mixed-adam"
    flash_attention: bool = False
    dropout: bool = True
    max_bubble: float | None = None
    max_cp: int = 8
    max_virtual: int = 8
    micro_batches: tuple[int, ...] = field(default=MICRO_BATCHES)
    fixed: tuple[tuple[str, int], ...] = ()  # degrees held fixed, e.g. (("dp", 1),)
    # the toolbox: what the training system offers (a 2021 Megatron had no sequence
    # parallelism, no selective recompute and no sharded optimizer)
    recompute: tuple[str, ...] = RECOMPUTE
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    sequence_parallel: bool = True
    schedules: tuple[str, ...] = ("1f1b",)  # + zb-h1, zb-h2 (one chunk), zbv (two)


def check(job: Job) -> None:
    """Refuse inputs no layout could mean, naming the value and what would work."""
    if job.devices < 1 or job.batch < 1:
        raise cm.CostModelError(f"need devices and batch >= 1, got {job.devices}, {job.batch}")
    n = job.device.node_size
    if job.devices > n and job.devices % n:
        raise cm.CostModelError(f"{job.devices} devices do not fill whole nodes of {n}: "
                                f"use a multiple of {n}")
    if not 0 < job.usable <= 1 or not 0 < job.efficiency <= 1:
        raise cm.CostModelError(f"usable and efficiency are fractions in (0, 1], got "
                                f"{job.usable}, {job.efficiency}")
    for k, x in job.fixed:
        if k not in FIXABLE or x < (0 if k == "zero" else 1) or (k == "zero" and x > 3):
            raise cm.CostModelError(f"cannot fix {k}={x}: fix one of {', '.join(FIXABLE)} to "
                                    "a whole number >= 1 (zero: 0-3)")
    _check_fixed_mesh(job)
    if job.max_bubble is not None and not 0 <= job.max_bubble:
        raise cm.CostModelError(f"max bubble must be >= 0, got {job.max_bubble}")
    if not job.schedules or set(job.schedules) - {"1f1b", *ZERO_BUBBLE}:
        raise cm.CostModelError(f"schedules {', '.join(job.schedules) or '(none)'}: choose "
                                f"from 1f1b, {', '.join(ZERO_BUBBLE)}")


def _check_fixed_mesh(job: Job) -> None:
    """A degree fixed twice, or mesh degrees that cannot multiply to the device count,
    would leave no mesh to consider: refused here, by name."""
    values: dict[str, set[int]] = {}
    for k, x in job.fixed:
        values.setdefault(k, set()).add(x)
    twice = sorted(k for k, xs in values.items() if len(xs) > 1)
    if twice:
        shown = " and ".join(f"{twice[0]}={x}" for x in sorted(values[twice[0]]))
        raise cm.CostModelError(f"--fix gives {shown}; fix each degree once")
    mesh = {k: x for k, x in job.fixed if k in ("dp", "tp", "pp", "cp")}
    for k, x in mesh.items():
        if job.devices % x:
            raise cm.CostModelError(f"cannot fix {k}={x}: it must divide the {job.devices} "
                                    f"devices; choose {k} from {divisors(job.devices)}")
    product = math.prod(mesh.values())
    if job.devices % product or (len(mesh) == 4 and product != job.devices):
        shown = " x ".join(f"{k}={x}" for k, x in mesh.items())
        must = "equal" if len(mesh) == 4 else "divide"
        raise cm.CostModelError(f"cannot fix {shown}: their product {product} must {must} "
                                f"the {job.devices} devices")
    ep = dict(job.fixed).get("ep", 1)
    if ep > 1 and (not job.shape.experts or job.shape.experts % ep or job.devices % ep):
        raise cm.CostModelError(f"cannot fix ep={ep}: ep splits a mixture of experts' experts "
                                f"and must divide them ({job.shape.experts or 'none here'}) "
                                f"and the {job.devices} devices")
    if mesh.get("cp", 1) > job.max_cp:
        raise cm.CostModelError(f"cannot fix cp={mesh['cp']}: the planner considers cp up "
                                f"to {job.max_cp}")


def mesh_reason(job: Job, tp: int, pp: int, cp: int) -> str | None:
    """The first of rule 2's mesh conditions that (tp, pp, cp) breaks; None if none."""
    s = job.shape
    if job.device.node_size % tp or s.heads % tp or s.kv % tp:
        return "tp"
    if s.layers % pp:
        return "pp"
    if s.seq % cp:
        return "cp"
    return None


def structural_reason(job: Job, lay: Layout) -> str | None:
    """The first of rule 2's conditions that `lay` breaks, as a REASONS key; None if none."""
    reason = mesh_reason(job, lay.tp, lay.pp, lay.cp)
    if reason:
        return reason
    if job.shape.layers % (lay.pp * lay.virtual):
        return "pp"
    if job.batch % (lay.dp * lay.ep * lay.micro_batch):
        return "batch"
    if lay.virtual > 1 and not lay.zero_bubble and lay.micro_batches(job.batch) % lay.pp:
        return "interleave"
    if lay.micro_batches(job.batch) < least_micro_batches(lay.schedule, lay.pp):
        return "zero_bubble"
    return None


def evaluate(job: Job, lay: Layout) -> dict:
    """One layout's row: degrees, memory, predicted time, whether it fits."""
    mem = memory(job.shape, lay, job.batch, job.budget, "none", job.flash_attention,
                 job.dropout)
    t = step_time(job.shape, lay, job.batch, job.device, job.efficiency, job.budget)
    return {"layout": lay.as_dict(), "name": lay.name(), "micro_batches":
            lay.micro_batches(job.batch), "memory": mem, "of_device": mem["total"] /
            job.device.memory, "fits": mem["total"] <= job.usable * job.device.memory,
            "time": t}


def _fixed_ok(job: Job, **degrees) -> bool:
    return all(degrees[k] == x for k, x in job.fixed if k in degrees)


def meshes(job: Job):
    """Every devices = dp x tp x pp x cp (cp <= max_cp) that the fixed degrees allow (a
    mixture of experts' dp is dp x ep: a fixed dp or ep is held in `options`)."""
    for tp in divisors(job.devices):
        for cp in (c for c in divisors(job.devices // tp) if c <= job.max_cp):
            for pp in divisors(job.devices // (tp * cp)):
                dp = job.devices // (tp * cp * pp)
                rows = {} if job.shape.experts else {"dp": dp}
                if _fixed_ok(job, tp=tp, pp=pp, cp=cp, **rows):
                    yield dp, tp, pp, cp


def options(job: Job, dp: int, tp: int, pp: int, cp: int):
    """Rule 1's options on one mesh: v (pp > 1), micro-batch, ZeRO (dp > 1), recompute; a
    mixture of experts' ep (a share of dp dividing the experts: the rows stay split over
    dp x ep)."""
    experts = job.shape.experts
    for ep in [e for e in divisors(dp) if experts and experts % e == 0] or [1]:
        if _fixed_ok(job, ep=ep, dp=dp // ep):
            yield from _options(job, dp // ep, tp, pp, cp, ep)


def _options(job: Job, dp: int, tp: int, pp: int, cp: int, ep: int):
    vs = [v for v in divisors(job.shape.layers // pp) if v <= job.max_virtual] if pp > 1 else [1]
    sp = tp > 1 and job.sequence_parallel
    for v in vs:
        # the job's schedules with v chunks (v = 1: 1F1B's "", zb-h1, zb-h2; v = 2: zbv),
        # and interleaved 1F1B for every v > 1
        for zb in [""] * (v > 1 or pp == 1 or "1f1b" in job.schedules) + [
                s for s in job.schedules if pp > 1 and ZERO_BUBBLE.get(s) == v]:
            for mb, zero, rc in itertools.product(job.micro_batches, job.zero_stages if dp > 1
                                                  else (0,), job.recompute):
                lay = Layout(dp, tp, pp, cp, v, sp, zero, rc, mb, zb, ep)
                if _fixed_ok(job, virtual=v, micro_batch=mb, zero=zero):
                    yield lay


def search(job: Job) -> dict:
    """Rules 1-5 over every mesh: the fitting rows (unsorted), rejections per mesh, the
    closest memory miss. A mesh is rejected when none of its options fits, for the reason
    that came last in the rules (memory before batch before structure)."""
    check(job)
    fitting, rejected, considered, closest = [], {}, 0, None
    for dp, tp, pp, cp in meshes(job):
        considered += 1
        reason = mesh_reason(job, tp, pp, cp)
        kept, why = 0, set()
        for lay in () if reason else options(job, dp, tp, pp, cp):
            r = structural_reason(job, lay)
            if r:
                why.add(r)
                continue
            row = evaluate(job, lay)
            if not row["fits"]:
                why.add("memory")
                if closest is None or row["memory"]["total"] < closest["memory"]["total"]:
                    closest = row
            elif job.max_bubble is not None and row["time"]["bubble_over_ideal"] > job.max_bubble:
                why.add("bubble")
            else:
                fitting.append(row)
                kept += 1
        if not kept and (reason or why):  # a mesh the fixed degrees left no option on
            reason = reason or next(r for r in ("bubble", "memory", "zero_bubble", "interleave",
                                                "batch", "pp")
                                    if r in why)
            rejected[REASONS[reason]] = rejected.get(REASONS[reason], 0) + 1
    return {"rows": fitting, "considered": considered, "rejected": rejected,
            "closest": closest}


def plan(job: Job, top: int = 5) -> dict:
    """Search, filter by RULES, rank; the recommendation, the next `top`, the rejections.
    `considered` and `rejected` count meshes (dp, tp, pp, cp); `fitting` counts layouts."""
    found = search(job)
    fitting = sorted(found["rows"], key=lambda r: (r["time"]["step"], r["memory"]["total"]))
    return {"job": {**asdict(job), "shape": job.shape.as_dict(), "device": job.device.as_dict()},
            "rules": RULES, "considered": found["considered"], "fitting": len(fitting),
            "recommended": fitting[0] if fitting else None,
            "alternatives": fitting[1:1 + top], "rejected": found["rejected"],
            "closest_memory_miss": found["closest"] if not fitting else None}


def ranked(job: Job) -> list[dict]:
    """Every fitting row, fastest first (plan() keeps only the top; tests read the ranks)."""
    return sorted(search(job)["rows"], key=lambda r: (r["time"]["step"], r["memory"]["total"]))


def rank_of(rows: list[dict], **degrees) -> int | None:
    """1-based rank of the best row whose layout has these degrees (e.g. tp=8, pp=8)."""
    for i, r in enumerate(rows, 1):
        if all(r["layout"][k] == v for k, v in degrees.items()):
            return i
    return None
