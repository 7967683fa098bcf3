"""Choose a dp x tp x pp x ZeRO layout for a model on a cluster, from closed forms only.

The rules, in the order they are applied (RULES says the same in words):

 1. Every factorisation devices = dp x tp x pp is a candidate.
 2. Tensor parallelism stays inside a node (it all-reduces activations in every layer, on
    the critical path): tp divides the node size. It splits attention by heads: tp divides
    heads. Pipeline stages hold whole layers: pp divides layers. Each data-parallel replica
    gets whole micro-batches: dp x micro_batch divides the global batch.
 3. The pipeline bubble (p-1)/(m+p-1), m = batch / (dp x micro_batch) micro-batches per
    replica, must not exceed max_bubble (lecture 13 exercise 3 uses 10%).
 4. Memory per device (see layout_memory) must fit in usable x device memory. For each
    (dp, tp, pp) the first option that fits is kept, in the order ZeRO 0, 1, 2, 3 without
    recomputation, then ZeRO 0, 1, 2, 3 with it: the smallest ZeRO stage that fits, and
    recomputation (a third more compute) only when nothing fits without it.
 5. Placement: tp innermost (one node, NVLink), then pp, then dp outermost. A pipeline hop
    is inside a node if tp x pp <= node size, else across nodes (InfiniBand); the dp
    gradient all-reduce is across nodes whenever the job spans more than one node.
 6. Fitting layouts are ranked by communication time per step (layout_comm: TP + PP + DP,
    summed, no overlap with compute assumed), then by bubble, then fewer tp; the first is
    recommended. Rejected candidates are counted by the first rule they break.

This is a teaching model: embeddings, logits, temporary buffers and fragmentation are left
to the (1 - usable) reserve; compute time and overlap are not modelled.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from jaxscale import costmodel as cm

# Published shapes (layers, hidden, heads) and parameter counts, to assume a shape when
# only a parameter count is given. Dense attention + 4h MLP is assumed for all of them.
REFERENCE_SHAPES = {
    "GPT-3 XL": (1.3e9, 24, 2048, 24),
    "Llama-2-7B": (6.74e9, 32, 4096, 32),
    "Llama-2-13B": (13.0e9, 40, 5120, 40),
    "LLaMA-33B": (32.5e9, 60, 6656, 52),
    "Llama-2-70B": (69e9, 80, 8192, 64),
    "GPT-3 175B": (175e9, 96, 12288, 96),
    "MT-NLG 530B": (530e9, 105, 20480, 128),
}

RULES = [  # the docstring's rules, one line each (printed by `jaxscale plan`)
    "every factorisation devices = dp x tp x pp is a candidate",
    ("tp divides the node size (tensor parallelism stays inside a node) and the heads; pp "
     "divides the layers; dp x micro-batch divides the global batch"),
    "pipeline bubble (p-1)/(m+p-1) <= max bubble",
    ("memory per device <= usable fraction x device memory: smallest ZeRO stage that fits, "
     "recomputation only if nothing fits without it"),
    ("placement: tp inside a node (intra-node link), pp next (inter-node link once tp x pp > "
     "node size), dp outermost (inter-node link once the job spans nodes)"),
    "rank by communication time per step (TP + PP + DP), then bubble, then smaller tp",
]

REASONS = {  # rejection reason: key -> words
    "tp_node": "tp does not divide the node size",
    "tp_heads": "tp does not divide the heads",
    "pp_layers": "pp does not divide the layers",
    "batch": "dp x micro-batch does not divide the batch",
    "bubble": "pipeline bubble above the maximum",
    "memory": "does not fit even with ZeRO-3 and recomputation",
}

MEMORY_OPTIONS = [(z, False) for z in range(4)] + [(z, True) for z in range(4)]


def divisors(n: int) -> list[int]:
    """The divisors of n in increasing order (trial division up to sqrt(n))."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def describe_reference(name: str) -> str:
    """'Llama-2-7B (32 layers, h = 4096, 32 heads, 6.74e+09 parameters)'."""
    params, layers, hidden, heads = REFERENCE_SHAPES[name]
    return f"{name} ({layers} layers, h = {hidden}, {heads} heads, {params:.3g} parameters)"


def nearest_reference(params: float) -> tuple[str, tuple]:
    """The reference model whose parameter count is nearest on a log scale."""
    name = min(REFERENCE_SHAPES, key=lambda k: abs(math.log(REFERENCE_SHAPES[k][0] / params)))
    return name, REFERENCE_SHAPES[name]


def estimate_params(layers: int, hidden: int, ffn: int | None = None, vocab: int = 0) -> float:
    """Weights of a dense transformer: L x (4h^2 attention + 2 h ffn MLP) + vocab x h."""
    ffn = 4 * hidden if ffn is None else ffn
    return layers * (4 * hidden * hidden + 2 * hidden * ffn) + vocab * hidden


@dataclass(frozen=True)
class Workload:
    """The model and one training step: batch is global, in sequences of seq tokens."""
    params: float
    layers: int
    hidden: int
    heads: int
    seq: int = 4096
    batch: int = 256
    micro_batch: int = 1
    flash_attention: bool = False
    grad_bytes: int = 2
    act_bytes: int = 2


@dataclass(frozen=True)
class Cluster:
    """Devices in nodes of node_size; memory in bytes; links in bytes/s per device."""
    devices: int
    node_size: int = 8
    memory: float = 80e9
    usable: float = 0.9
    intra: float = cm.LINKS["nvlink"]
    inter: float = cm.LINKS["infiniband"]
    max_bubble: float = 0.1


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    zero_stage: int = 0
    recompute: bool = False


def check(w: Workload, c: Cluster) -> None:
    """Refuse inputs no layout could mean, naming the value and what would work."""
    for name in ("layers", "hidden", "heads", "seq", "batch", "micro_batch"):
        if getattr(w, name) < 1:
            raise cm.CostModelError(f"{name} must be >= 1, got {getattr(w, name)}")
    if not w.params > 0:
        raise cm.CostModelError(f"params must be > 0, got {w.params}")
    if w.hidden % w.heads:
        raise cm.CostModelError(f"hidden {w.hidden} is not divisible by heads {w.heads}")
    if c.devices < 1 or c.node_size < 1 or not c.memory > 0:
        raise cm.CostModelError(f"need devices, node size >= 1 and memory > 0, got "
                                f"{c.devices}, {c.node_size}, {c.memory}")
    if c.devices > c.node_size and c.devices % c.node_size:
        raise cm.CostModelError(f"{c.devices} devices do not fill whole nodes of {c.node_size}: "
                                f"use a multiple of {c.node_size}")
    if not 0 < c.usable <= 1 or not 0 <= c.max_bubble < 1:
        raise cm.CostModelError(f"need 0 < usable <= 1 and 0 <= max bubble < 1, got "
                                f"{c.usable}, {c.max_bubble}")


def micro_batches(w: Workload, dp: int) -> int:
    return w.batch // (dp * w.micro_batch)


def layout_memory(w: Workload, c: Cluster, lay: Layout) -> dict[str, float]:
    """Bytes per device: model states, ZeRO-3's gathered layer, activations (1F1B).

    States: the tp x pp model-parallel shard (params / (tp pp)) under ZeRO over dp. ZeRO-3
    also holds one gathered layer of 16-bit parameters while it computes. Activations: a
    stage of L/pp layers keeps min(m, pp) micro-batches in flight under 1F1B (one when
    pp = 1: gradient accumulation), each layer's by Korthikanti with tp; with recomputation
    only each layer's input per micro-batch in flight plus one layer being recomputed.
    """
    shard = w.params / (lay.tp * lay.pp)
    states = cm.model_state_bytes(shard, lay.dp, lay.zero_stage)
    gathered = 2 * w.params / (w.layers * lay.tp) if lay.zero_stage == 3 and lay.dp > 1 else 0.0
    here = w.layers // lay.pp
    in_flight = min(micro_batches(w, lay.dp), lay.pp)
    one = cm.activation_bytes_per_layer(w.seq, w.micro_batch, w.hidden, w.heads,
                                        w.flash_attention, lay.tp)
    if lay.recompute:
        acts = here * in_flight * 2 * w.seq * w.micro_batch * w.hidden + one
    else:
        acts = here * in_flight * one
    out = {"params": states["params"], "grads": states["grads"],
           "optimizer": states["optimizer"], "zero3_gathered_layer": gathered,
           "activations": acts}
    out["total"] = sum(out.values())
    return out


def layout_comm(w: Workload, c: Cluster, lay: Layout) -> dict:
    """Bytes each device sends per step, and seconds on its link, for TP, PP and DP."""
    replica_batch = w.batch // lay.dp
    tp = cm.tp_step_volume(w.layers // lay.pp, w.seq, replica_batch, w.hidden, lay.tp,
                           w.act_bytes, lay.recompute)["ring_bytes_per_device"]
    pp = cm.pp_step_volume(w.seq, replica_batch, w.hidden, lay.pp, w.act_bytes)[
        "max_bytes_per_device"]
    grads = w.params / (lay.tp * lay.pp) * w.grad_bytes
    dp = cm.ring_all_reduce_bytes(grads, lay.dp) * (1.5 if lay.zero_stage == 3 else 1.0)
    pp_link = c.intra if lay.tp * lay.pp <= c.node_size else c.inter
    dp_link = c.intra if c.devices <= c.node_size else c.inter
    out = {"tp_bytes": tp, "tp_seconds": tp / c.intra,
           "pp_bytes": pp, "pp_seconds": pp / pp_link, "pp_across_nodes": pp_link == c.inter,
           "dp_bytes": dp, "dp_seconds": dp / dp_link, "dp_across_nodes": dp_link == c.inter}
    out["seconds"] = out["tp_seconds"] + out["pp_seconds"] + out["dp_seconds"]
    return out


def structural_reason(w: Workload, c: Cluster, dp: int, tp: int, pp: int) -> str | None:
    """The first of rules 2-3 that (dp, tp, pp) breaks, as a REASONS key; None if none.

    (Rule 3's m: with dp x micro_batch dividing the batch, m = batch / (dp x micro_batch).)
    """
    if c.node_size % tp:
        return "tp_node"
    if w.heads % tp:
        return "tp_heads"
    if w.layers % pp:
        return "pp_layers"
    if w.batch % (dp * w.micro_batch):
        return "batch"
    if cm.bubble_fraction(pp, micro_batches(w, dp)) > c.max_bubble:
        return "bubble"
    return None


def evaluate(w: Workload, c: Cluster, lay: Layout) -> dict:
    """One layout's row: its degrees, memory, communication and bubble."""
    mem = layout_memory(w, c, lay)
    return {**asdict(lay), "micro_batches": micro_batches(w, lay.dp),
            "bubble": cm.bubble_fraction(lay.pp, micro_batches(w, lay.dp)),
            "memory": mem, "of_device": mem["total"] / c.memory,
            "fits": mem["total"] <= c.usable * c.memory,
            "comm": layout_comm(w, c, lay)}


def plan(w: Workload, c: Cluster, top: int = 5) -> dict:
    """Enumerate, filter by RULES, rank; the recommendation, alternatives and rejections.

    closest_memory_miss is the layout that came nearest to fitting (ZeRO-3 with
    recomputation, least memory) among those rejected for memory alone.
    """
    check(w, c)
    fitting, rejected, considered, closest = [], {}, 0, None
    factors = divisors(c.devices)
    for tp in factors:
        for pp in (d for d in factors if (c.devices // tp) % d == 0):
            dp = c.devices // (tp * pp)
            considered += 1
            reason = structural_reason(w, c, dp, tp, pp)
            if reason is None:
                for z, rc in MEMORY_OPTIONS:  # the first option that fits (rule 4)
                    row = evaluate(w, c, Layout(dp, tp, pp, z, rc))
                    if row["fits"]:
                        fitting.append(row)
                        break
                else:  # row is ZeRO-3 with recomputation, the least memory on offer
                    reason = "memory"
                    if closest is None or row["memory"]["total"] < closest["memory"]["total"]:
                        closest = row
            if reason:
                rejected[REASONS[reason]] = rejected.get(REASONS[reason], 0) + 1
    fitting.sort(key=lambda r: (r["comm"]["seconds"], r["bubble"], r["tp"], r["pp"]))
    return {"workload": asdict(w), "cluster": asdict(c), "rules": RULES,
            "considered": considered, "fitting": len(fitting),
            "recommended": fitting[0] if fitting else None,
            "alternatives": fitting[1:1 + top], "rejected": rejected,
            "closest_memory_miss": closest}
