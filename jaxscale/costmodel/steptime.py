"""Step time of a layout: FLOPs at an achieved rate, the bubble, and the exposed communication.

FLOPs per token (the convention of jaxscale.model.flops, PaLM and Megatron; Korthikanti eq. 7):
  model      6 N + 12 L s h      N = matmul weights: the blocks' and the output head's (an
                                 untied input embedding is a lookup), attention non-causal
  recompute  selective: 4 L s h (the attention core's forward again)
             full:      2 N_blocks + 4 L s h (every block's forward again)
             (latent attention: 4 L s h becomes 2 L s (q columns + v columns), shape.core_flops)
  hardware   model + recompute   (HFU counts it, MFU does not)

Per device and step (B sequences of s tokens, d = dp x tp x pp x cp devices):

  compute   B s hardware / d / (peak x efficiency). `efficiency` is the fraction of the
            datasheet peak the model's matmuls reach (a stated assumption; measured on this
            machine by jaxscale.measure.hardware.measure_matmul_peak for the CPU calibration)
  bubble    compute x (p-1) / (v m)        Narayanan et al.'s bubble over ideal time (1F1B
            and GPipe v = 1; interleaved 1F1B v chunks per device), m micro-batches; a
            third of it, (p-1) / (3m), for zb-h1 and zb-h2 (costmodel.schedule)
  tp        on the critical path: per layer (L/p of them) and micro-batch, 4 all-reduces of
            b (s/cp) h 16-bit activations (6 with full recompute); with sequence
            parallelism all-gathers + reduce-scatters of the same time
  cp        ring attention: per layer and micro-batch (cp-1) hops of k and v forward, twice
            that backward (k, v and their gradients); hidden behind the attention's own
            compute, only the excess is exposed
  pp        each micro-batch crosses each of its v chunk boundaries forward and backward:
            2 v m sends of b (s/cp) h / tp 16-bit values (Megatron's scatter-gather)
  ep        a mixture of experts: per MoE layer and micro-batch, 4 all-to-alls (dispatch
            and combine, forward and backward) of the device's cf x top_k b (s/cp) h 16-bit
            values (cf the capacity factor; 1 for dropless: a grouped matmul that sends no
            padding; jaxscale's own dropless layer sends E / top_k times that, its fixed
            places padded: jaxscale.compare.predict counts those), on the critical path

  dp        gradients of the Psi/(tp pp) shard over the dp x cp devices that hold the same
            weights (Megatron's data-and-context group; ZeRO shards over it too): ZeRO 0-1
            one all-reduce after the last micro-batch, hidden behind that micro-batch's
            backward; ZeRO-2 a reduce-scatter per micro-batch + one all-gather of the
            weights, behind the whole backward; ZeRO-3 two weight all-gathers and a
            reduce-scatter per micro-batch, behind all of the compute. The backward is 2/3
            of the model FLOPs plus all of the recompute. Only the excess over the window is
            exposed. With experts, their gradients (split over ep) over dp x cp, the rest's
            over dp x cp x ep.

A mixture of experts' FLOPs are its active parameters' (top_k experts per token).
Placement, innermost first: tp, cp, pp, ep, dp (jaxscale's mesh order). An axis whose devices
together with the inner ones fit in a node uses the device's intra link (bidirectional on a
TPU torus), else its inter link. step = compute + bubble + tp + pp + exposed cp + exposed dp.
"""
from __future__ import annotations

from jaxscale.costmodel import schedule as schedule_model
from jaxscale.costmodel.collectives import collective_bytes, collective_seconds
from jaxscale.costmodel.devices import Device
from jaxscale.costmodel.layout import Layout, check
from jaxscale.costmodel.shape import ShapeError, Transformer
from jaxscale.costmodel.states import BUDGETS

ACT_BYTES = 2  # 16-bit activations on the wire


def flops_per_token(shape: Transformer, recompute: str = "none") -> dict[str, float]:
    """Model, recompute and hardware FLOPs per trained token (module docstring)."""
    h = shape.hidden
    blocks = shape.blocks_params(active=True)  # a mixture of experts: the top_k a token uses
    matmul = blocks + shape.vocab * h  # the input embedding is a lookup
    core = shape.core_flops()  # 4 L s h forward (latent attention: its own widths)
    model = 6 * matmul + 3 * core
    extra = {"none": 0, "selective": core, "full": 2 * blocks + core}
    if recompute not in extra:
        raise ShapeError(f"unknown recompute {recompute!r}; choose from {', '.join(extra)}")
    return {"model": model, "recompute": extra[recompute], "hardware": model + extra[recompute]}


def links(lay: Layout, dev: Device) -> dict[str, tuple[float, bool]]:
    """(bandwidth, bidirectional) of each mesh axis, placed tp, cp, pp, ep, dp from the
    inside."""
    out, inner = {}, 1
    for axis in ("tp", "cp", "pp", "ep", "dp"):
        inner *= getattr(lay, axis)
        within = inner <= dev.node_size
        out[axis] = (dev.intra, dev.bidirectional) if within else (dev.inter, False)
    return out


def step_time(shape: Transformer, lay: Layout, batch: int, dev: Device,
              efficiency: float = 0.7, budget: str = "mixed-adam",
              overlap: bool = True) -> dict:
    """Predicted seconds per step, by part, with tokens/s, MFU and HFU (module docstring)."""
    check(shape, lay, batch)
    if not 0 < efficiency <= 1:
        raise ShapeError(f"efficiency is a fraction of the peak in (0, 1], got {efficiency}")
    d, m = lay.devices, lay.micro_batches(batch)
    fl = flops_per_token(shape, lay.recompute)
    tokens = batch * shape.seq
    compute = tokens * fl["hardware"] / d / (dev.peak * efficiency)
    bubble_share = schedule_model.bubble_over_ideal(lay.schedule, lay.pp, m, lay.virtual)
    bubble = compute * bubble_share
    net = links(lay, dev)
    sent = {"tp": 0.0, "cp": 0.0, "pp": 0.0, "ep": 0.0, "dp": 0.0}  # bytes per device per step

    group = {"tp": lay.tp, "cp": lay.cp, "pp": lay.pp, "ep": lay.ep, "dp": lay.dp * lay.cp}

    def coll(kind, n, axis, times=1, k=None):
        bw, bidi = net[axis]
        k = group[axis] if k is None else k
        sent[axis] += times * collective_bytes(kind, n, k)
        return times * collective_seconds(kind, n, k, bw, dev.latency, bidi)

    layers_here = shape.layers // lay.pp
    local = lay.micro_batch * shape.seq // lay.cp  # tokens of one micro-batch on a device
    act = local * shape.hidden * ACT_BYTES
    per_layer = 6 if lay.recompute == "full" else 4
    tp = coll("all_reduce", act, "tp", layers_here * m * per_layer)
    ep = (coll("all_to_all", shape.capacity_factor * shape.top_k * act, "ep",  # (the
               -(-shape.moe_layers // lay.pp) * m * 4) if lay.ep > 1 else 0.0)  # busiest stage's)

    k_and_v = sum(shape.columns) if shape.latent else 2 * shape.kv_hidden
    kv = local * k_and_v * ACT_BYTES  # k and v of this device's tokens
    hops = (lay.cp - 1) * (3 + (lay.recompute == "full"))
    cp_bw = net["cp"][0]
    cp_total = layers_here * m * hops * (dev.latency + kv / cp_bw) if lay.cp > 1 else 0.0
    sent["cp"] = layers_here * m * hops * kv if lay.cp > 1 else 0.0
    attention = compute * 3 * shape.core_flops() / fl["hardware"]
    cp = max(0.0, cp_total - attention) if overlap else cp_total

    send = act / lay.tp
    pp = 2 * lay.virtual * m * (dev.latency + send / net["pp"][0]) if lay.pp > 1 else 0.0
    sent["pp"] = 2 * lay.virtual * m * send if lay.pp > 1 else 0.0

    backward = compute * (2 / 3 * fl["model"] + fl["recompute"]) / fl["hardware"]
    window = backward / m if lay.zero <= 1 else backward if lay.zero == 2 else compute
    dp_total = _data_parallel(shape, lay, budget, m, coll)
    dp = max(0.0, dp_total - window) if overlap else dp_total

    step = compute + bubble + tp + pp + cp + dp + ep
    per_s = tokens / step
    return {"compute": compute, "bubble": bubble, "tp": tp, "pp": pp, "cp": cp, "dp": dp,
            "ep": ep,
            "cp_total": cp_total, "dp_total": dp_total, "step": step,
            "bytes_sent": sent, "bytes_sent_total": sum(sent.values()),
            "bubble_over_ideal": bubble_share,
            "tokens_per_s": per_s, "flops_per_token": fl,
            "mfu": fl["model"] * per_s / (d * dev.peak),
            "hfu": fl["hardware"] * per_s / (d * dev.peak),
            "links": {k: {"bandwidth": v[0], "bidirectional": v[1]} for k, v in net.items()}}


def _data_parallel(shape: Transformer, lay: Layout, budget: str, m: int, coll) -> float:
    """Seconds of the gradients' reduction over the devices that hold the same weights
    (module docstring): the shard of Psi / (tp pp) over dp x cp; with experts, theirs
    (split over ep too) over dp x cp, and the rest over dp x cp x ep."""
    w_bytes, g_bytes, _ = BUDGETS[budget]
    experts = shape.expert_params()
    parts = [((shape.params() - experts) / (lay.tp * lay.pp), lay.dp * lay.cp * lay.ep)]
    if experts:
        parts.append((experts / (lay.ep * lay.tp * lay.pp), lay.dp * lay.cp))
    total = 0.0
    for shard, k in parts:
        if lay.zero <= 1:
            total += coll("all_reduce", shard * g_bytes, "dp", k=k)
        elif lay.zero == 2:
            total += (coll("reduce_scatter", shard * g_bytes, "dp", m, k=k)
                      + coll("all_gather", shard * w_bytes, "dp", k=k))
        else:
            total += (coll("all_gather", shard * w_bytes, "dp", 2 * m, k=k)
                      + coll("reduce_scatter", shard * g_bytes, "dp", m, k=k))
    return total
