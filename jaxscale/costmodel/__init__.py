"""Closed-form costs of training: the lectures' calculators, and the package of the full model.

The package, one idea per module (each docstring gives its formulas and sources):
  shape.py        the transformer's shape (d_ff, SwiGLU, GQA) and its parameter count
  activations.py  Korthikanti et al.'s activations, term by term: tp, sp, cp, pp, recompute
  states.py       parameters, gradients, optimizer under ZeRO, byte budgets, offload, the
                  largest model that fits, DeepSpeed's estimator
  layout.py       a dp x tp x pp x cp layout and its memory on the busiest device
  collectives.py  the time of a collective: latency + bytes / bandwidth, ring or torus
  devices.py      the accelerator table: peak FLOP/s, memory, HBM and link bandwidths
  steptime.py     FLOPs and step time of a layout: compute, bubble, exposed communication
  units.py        reading sizes and counts ("80GB", "7B") and printing bytes in GB and GiB
This module keeps the lectures' figures (volumes per device, the lecture links, ZeRO on one
axis, LoRA/QLoRA) and delegates its memory formulas to the modules above.

Communication, per-device bytes sent (K devices, a vector of n bytes):
  ring reduce-scatter or all-gather   (K-1)/K x n
  ring all-reduce                     2(K-1)/K x n     (reduce-scatter + all-gather)
  parameter server (device 0)         (K-1) x n sent and (K-1) x n received
  tensor parallel (Megatron)          4 all-reduces of b*s*h activations per layer per step
  pipeline parallel                   b*s*h activations forward + their gradients back, per
                                      stage boundary per step
Time = bytes / link bandwidth (bandwidth-bound; latency ignored, overlap with compute not
counted). The link presets are the lectures' round figures, per GPU and direction.

Memory: model states (parameters, gradients, Adam state) per device under ZeRO 0-3;
activations by Korthikanti et al. (2022), with tensor parallelism, flash attention and
per-layer recomputation; LoRA and QLoRA fine-tuning. Sizes are bytes; GB = 1e9, GiB = 2^30.
Pipeline bubble, two definitions: `bubble_over_total` (idle / all time, the lectures') and
`bubble_over_ideal` (Narayanan et al.'s). Failure and checkpoint formulas are in
jaxscale.costmodel.failures, layout search in jaxscale.costmodel.planner.
"""
from __future__ import annotations

import math

# Plain modules that import nothing of this one (shape.py imports nothing at all), so the
# package can import them at its top without a circle.
from jaxscale.costmodel import activations, states
from jaxscale.costmodel import schedule as schedule_model
from jaxscale.costmodel.shape import ShapeError, Transformer

LINKS = {  # bytes per second
    "nvlink": 300e9,  # NVLink within a node (lecture 13: 300 GB/s and up)
    "infiniband": 50e9,  # between nodes (lecture 13 exercises 4 and 6: ~50 GB/s)
    "ethernet": 1.25e9,  # 10 Gb/s Ethernet
}


class CostModelError(ValueError):
    """An argument of a cost formula is out of range."""


def _positive(**values) -> None:
    for name, v in values.items():
        if not v >= 1:
            raise CostModelError(f"{name} must be >= 1, got {v}")


def _check(k: int, n_bytes: float) -> None:
    if k < 1 or n_bytes < 0:
        raise CostModelError(f"need K >= 1 devices and n >= 0 bytes, got K={k}, n={n_bytes}")


def ring_reduce_scatter_bytes(n_bytes: float, k: int) -> float:
    _check(k, n_bytes)
    return (k - 1) / k * n_bytes


def ring_all_gather_bytes(n_bytes: float, k: int) -> float:
    _check(k, n_bytes)
    return (k - 1) / k * n_bytes


def ring_all_reduce_bytes(n_bytes: float, k: int) -> float:
    """Bytes each device sends in a ring all-reduce of an n-byte vector."""
    return ring_reduce_scatter_bytes(n_bytes, k) + ring_all_gather_bytes(n_bytes, k)


def parameter_server_bytes(n_bytes: float, k: int) -> dict[str, float]:
    """Device 0 receives every other device's vector and sends the sum back to each."""
    _check(k, n_bytes)
    return {"server_sent": (k - 1) * n_bytes, "server_received": (k - 1) * n_bytes,
            "worker_sent": n_bytes if k > 1 else 0.0}


def transfer_seconds(n_bytes: float, link: str) -> float:
    if link not in LINKS:
        raise CostModelError(f"unknown link {link!r}; choose from {', '.join(LINKS)}")
    return n_bytes / LINKS[link]


def dp_gradient_allreduce(n_params: float, k: int, grad_bytes: int = 4) -> dict[str, float]:
    """The data-parallel step's gradient all-reduce: payload and ring volume per device."""
    payload = n_params * grad_bytes
    return {"payload_bytes": payload, "ring_bytes_per_device": ring_all_reduce_bytes(payload, k)}


# --------------------------------------------------------------------------------------
# Memory: model states under ZeRO, activations (Korthikanti et al. 2022)
# --------------------------------------------------------------------------------------

STATE_BYTES = {  # bytes per parameter: (params, gradients, optimizer state) with Adam
    "mixed": (2, 2, 12),  # bf16/fp16 weights and gradients; fp32 master + m + v
    "fp32": (4, 4, 8),  # fp32 weights and gradients; fp32 m + v
}
BUDGET_OF = {"mixed": "mixed-adam", "fp32": "fp32-adam"}  # costmodel.states' names


def model_state_bytes(n_params: float, k: int, zero_stage: int = 0,
                      precision: str = "mixed") -> dict[str, float]:
    """Per-device bytes of parameters, gradients and optimizer state under ZeRO stage 0-3.

    Stage 1 shards the optimizer state over the K data-parallel devices, stage 2 also the
    gradients, stage 3 also the parameters (mixed precision: 16, 4 + 12/K, 2 + 14/K, 16/K
    bytes per parameter). The lectures' two budgets; costmodel.states has them all.
    """
    if precision not in STATE_BYTES:
        raise CostModelError(f"unknown precision {precision!r}; choose from {', '.join(STATE_BYTES)}")
    if zero_stage not in (0, 1, 2, 3):
        raise CostModelError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    _check(k, n_params)
    x = states.state_memory(n_params, k, zero_stage, BUDGET_OF[precision]) if n_params else {
        "params": 0.0, "grads": 0.0, "optimizer": 0.0}
    out = {"params": x["params"], "grads": x["grads"], "optimizer": x["optimizer"]}
    out["total"] = sum(out.values())
    return out


def activation_bytes_per_layer(seq: int, batch: int, hidden: int, heads: int,
                               flash_attention: bool = False, tp: int = 1) -> float:
    """Activations one transformer layer keeps for backward, 16-bit (Korthikanti et al.):
    s*b*h*(34 + 5*a*s/h); with flash attention the a*s*s attention maps are not stored: 34*s*b*h.
    With tensor parallelism over tp devices (no sequence parallelism): s*b*h*(10 + 24/tp +
    5*a*s/(h*tp)) (their eq. 2). Term by term in costmodel.activations (GPT shape, 4h MLP).
    """
    _positive(seq=seq, batch=batch, hidden=hidden, heads=heads, tp=tp)
    shape = Transformer(1, hidden, heads, seq)
    return activations.per_layer(shape, batch, tp, flash_attention=flash_attention)["total"]


def activation_bytes(layers: int, seq: int, batch: int, hidden: int, heads: int,
                     flash_attention: bool = False, recompute: bool = False,
                     tp: int = 1) -> float:
    """All layers' activations; with per-layer recomputation only each layer's 16-bit input
    (2*s*b*h, whole on every tensor-parallel device) is kept, plus one layer's full
    activations while it is recomputed."""
    one = activation_bytes_per_layer(seq, batch, hidden, heads, flash_attention, tp)
    if not recompute:
        return layers * one
    return layers * 2 * seq * batch * hidden + one


# --------------------------------------------------------------------------------------
# Fine-tuning memory: LoRA and QLoRA
# --------------------------------------------------------------------------------------

# NF4 as in QLoRA (Dettmers et al. 2023): 4 bits per weight, one 8-bit scale per block of 64
# weights, and ("double quantization") one fp32 scale per 256 of those 8-bit scales.
NF4_BITS, NF4_BLOCK, NF4_SCALE_BITS, NF4_SCALE_BLOCK = 4, 64, 8, 256
NF4_BYTES_PER_PARAM = (NF4_BITS + NF4_SCALE_BITS / NF4_BLOCK
                       + 32 / (NF4_BLOCK * NF4_SCALE_BLOCK)) / 8  # 0.5159 bytes


def lora_adapter_params(layers: int, hidden: int, rank: int, ffn: int | None = None,
                        kv_hidden: int | None = None, mlp_matrices: int = 2) -> int:
    """LoRA parameters when every linear layer of every block is adapted.

    An adapted d_in x d_out matrix W gets W + B A with A: rank x d_in and B: d_out x rank,
    r*(d_in + d_out) trainable parameters (2*r*(d_in + d_out) bytes in bf16). A block has
    Wq, Wo (hidden x hidden), Wk, Wv (hidden x kv_hidden: grouped-query attention; default
    hidden) and the MLP's mlp_matrices (2, or 3 with SwiGLU) hidden x ffn matrices; ffn
    defaults to 4 x hidden.
    """
    kv_hidden = hidden if kv_hidden is None else kv_hidden
    ffn = 4 * hidden if ffn is None else ffn
    _positive(layers=layers, hidden=hidden, rank=rank, ffn=ffn)
    if rank > hidden:
        raise CostModelError(f"LoRA rank {rank} is larger than hidden {hidden}: choose 1..{hidden}")
    per_block = (2 * rank * (hidden + hidden) + 2 * rank * (hidden + kv_hidden)
                 + mlp_matrices * rank * (hidden + ffn))
    return layers * per_block


def finetune_state_bytes(n_params: float, adapter_params: float, quantized: bool = False) -> dict:
    """Bytes of a LoRA (bf16 base) or QLoRA (NF4 base) fine-tune, one device holding it all.

    The base weights are frozen: no gradients and no optimizer state, 2 bytes each in bf16
    (LoRA) or NF4_BYTES_PER_PARAM with its block scales (QLoRA). The adapters are trained
    with mixed-precision Adam, 2 + 2 + 12 = 16 bytes per adapter parameter (STATE_BYTES).
    Activations come on top (they are about those of full training: backward still flows
    through the frozen layers to reach the adapters).
    """
    _check(1, n_params)
    _check(1, adapter_params)
    base = n_params * (NF4_BYTES_PER_PARAM if quantized else 2)
    p, g, o = STATE_BYTES["mixed"]
    out = {"base_weights": base, "adapter_params": adapter_params * p,
           "adapter_grads": adapter_params * g, "adapter_optimizer": adapter_params * o}
    out["total"] = sum(out.values())
    return out


# --------------------------------------------------------------------------------------
# Links, tensor- and pipeline-parallel volumes, the pipeline bubble
# --------------------------------------------------------------------------------------

def link_bandwidth(link: str | float) -> tuple[str, float]:
    """(name, bytes/s) of a preset link name or a bandwidth in GB/s ("25" -> 25e9 bytes/s)."""
    if isinstance(link, str) and link.lower() in LINKS:
        return link.lower(), LINKS[link.lower()]
    try:
        gbs = float(link)
    except (TypeError, ValueError):
        raise CostModelError(f"unknown link {link!r}; choose from {', '.join(LINKS)} or a "
                             "bandwidth in GB/s such as 25") from None
    if not math.isfinite(gbs):
        raise CostModelError(f"link bandwidth must be a finite number of GB/s, got {link}")
    if not gbs > 0:
        raise CostModelError(f"link bandwidth must be > 0 GB/s, got {link}")
    return f"{gbs:g} GB/s", gbs * 1e9


def tp_step_volume(layers: int, seq: int, batch: int, hidden: int, tp: int,
                   act_bytes: int = 2, recompute: bool = False) -> dict[str, float]:
    """Megatron tensor parallelism over tp devices, one training step of batch x seq tokens.

    Each layer all-reduces its b*s*h activations twice in forward (after attention, after
    the MLP) and their gradients twice in backward: 4 all-reduces per layer per step (6
    with full recomputation, which runs the forward, and its 2 all-reduces, again). The
    payload does not depend on tp; what each device sends in the ring does, 2(tp-1)/tp.
    """
    _positive(layers=layers, seq=seq, batch=batch, hidden=hidden, tp=tp, act_bytes=act_bytes)
    one = seq * batch * hidden * act_bytes
    count = (6 if recompute else 4) * layers
    return {"allreduce_bytes": one, "allreduces_per_step": count,
            "payload_bytes_per_step": one * count,
            "ring_bytes_per_device": count * ring_all_reduce_bytes(one, tp)}


def pp_step_volume(seq: int, batch: int, hidden: int, pp: int,
                   act_bytes: int = 2) -> dict[str, float]:
    """Pipeline parallelism over pp stages, one step of batch x seq tokens (all micro-batches).

    At each of the pp-1 stage boundaries the activations (b*s*h) go forward and their
    gradients (b*s*h) come back; a middle stage sends one of each.
    """
    _positive(seq=seq, batch=batch, hidden=hidden, pp=pp, act_bytes=act_bytes)
    one = seq * batch * hidden * act_bytes
    return {"activation_bytes": one, "boundary_bytes_per_step": 2 * one, "boundaries": pp - 1,
            "total_bytes_per_step": 2 * one * (pp - 1),
            "max_bytes_per_device": 2 * one if pp > 2 else one * (pp - 1)}


def bubble_over_total(pp: int, micro_batches: int, virtual: int = 1,
                      schedule: str = "1f1b") -> float:
    """Idle share of a pipeline's whole time: (p-1) / (v m + p - 1) (GPipe and 1F1B v = 1;
    interleaved 1F1B v chunks per device); the zero-bubble schedules (p-1) / (3m + p - 1)
    (costmodel.schedule). The lectures' and jaxscale.parallel.schedules's definition, which
    the event simulator measures."""
    ideal = bubble_over_ideal(pp, micro_batches, virtual, schedule)  # the same checks
    if schedule in schedule_model.ZERO_BUBBLE:
        return ideal / (1 + ideal)
    return (pp - 1) / (virtual * micro_batches + pp - 1)


def bubble_over_ideal(pp: int, micro_batches: int, virtual: int = 1,
                      schedule: str = "1f1b") -> float:
    """Bubble time over ideal (bubble-free) time: (p-1) / (v m), Narayanan et al. 2021's
    definition; = b / (1 - b) for b = bubble_over_total; a third of 1F1B's for the
    zero-bubble schedules (costmodel.schedule). The time model adds this x compute."""
    if pp < 1 or micro_batches < 1 or virtual < 1:
        raise CostModelError(f"need pp, micro_batches, virtual >= 1, got pp={pp}, "
                             f"micro_batches={micro_batches}, virtual={virtual}")
    try:
        return schedule_model.bubble_over_ideal(schedule, pp, micro_batches, virtual)
    except ShapeError as e:
        raise CostModelError(str(e)) from None
