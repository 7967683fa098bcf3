"""Closed-form costs: communication volume and time of collectives.

Per-device bytes sent (K devices, a vector of n bytes):
  ring reduce-scatter or all-gather   (K-1)/K x n
  ring all-reduce                     2(K-1)/K x n     (reduce-scatter + all-gather)
  parameter server (device 0)         (K-1) x n sent and (K-1) x n received
Time = bytes / link bandwidth (bandwidth-bound; latency ignored, overlap with compute not
counted). The link presets are the lectures' round figures, per GPU and direction.
"""
from __future__ import annotations

LINKS = {  # bytes per second
    "nvlink": 300e9,  # NVLink within a node (lecture 13: 300 GB/s and up)
    "infiniband": 50e9,  # between nodes (lecture 13 exercises 4 and 6: ~50 GB/s)
    "ethernet": 1.25e9,  # 10 Gb/s Ethernet
}


class CostModelError(ValueError):
    """An argument of a cost formula is out of range."""


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


def model_state_bytes(n_params: float, k: int, zero_stage: int = 0,
                      precision: str = "mixed") -> dict[str, float]:
    """Per-device bytes of parameters, gradients and optimizer state under ZeRO stage 0-3.

    Stage 1 shards the optimizer state over the K data-parallel devices, stage 2 also the
    gradients, stage 3 also the parameters (mixed precision: 16, 4 + 12/K, 2 + 14/K, 16/K
    bytes per parameter).
    """
    if precision not in STATE_BYTES:
        raise CostModelError(f"unknown precision {precision!r}; choose from {', '.join(STATE_BYTES)}")
    if zero_stage not in (0, 1, 2, 3):
        raise CostModelError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    _check(k, n_params)
    p, g, o = STATE_BYTES[precision]
    shard = lambda stage: k if zero_stage >= stage else 1  # noqa: E731
    out = {"params": p * n_params / shard(3), "grads": g * n_params / shard(2),
           "optimizer": o * n_params / shard(1)}
    out["total"] = sum(out.values())
    return out


def activation_bytes_per_layer(seq: int, batch: int, hidden: int, heads: int,
                               flash_attention: bool = False) -> float:
    """Activations one transformer layer keeps for backward, 16-bit (Korthikanti et al.):
    s*b*h*(34 + 5*a*s/h); with flash attention the a*s*s attention maps are not stored: 34*s*b*h."""
    sbh = seq * batch * hidden
    return sbh * 34 if flash_attention else sbh * (34 + 5 * heads * seq / hidden)


def activation_bytes(layers: int, seq: int, batch: int, hidden: int, heads: int,
                     flash_attention: bool = False, recompute: bool = False) -> float:
    """All layers' activations; with per-layer recomputation only each layer's 16-bit input
    (2*s*b*h) is kept, plus one layer's full activations while it is recomputed."""
    one = activation_bytes_per_layer(seq, batch, hidden, heads, flash_attention)
    if not recompute:
        return layers * one
    return layers * 2 * seq * batch * hidden + one
