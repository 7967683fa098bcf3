"""Model states per device: parameters, gradients, optimizer state; ZeRO 0-3; offload.

Bytes per parameter under each budget (weights, gradients, optimizer state):

  mixed-adam    2 + 2 + 12 = 16   bf16/fp16 weights and gradients; fp32 master, m, v (the
                                  ZeRO paper's K = 12)
  fp32-adam     4 + 4 +  8 = 16   fp32 weights and gradients; m, v
  bf16-moments  2 + 2 +  8 = 12   fp32 master; m and v in bf16 (MaxText's mu_dtype; what
                                  `train --optimizer-state-dtype bf16` holds, measured)
  adam8bit      2 + 2 +  6 = 10   fp32 master; m and v in 8 bits (Dettmers et al. 2022; the
                                  per-block scales, 2 x 4 bytes per 2048 values, left out)
  bf16          2 + 2 +  4 =  8   pure bf16: no master copy, m and v in bf16
  fp8           1 + 2 +  8 = 11   our label for FP8 matmuls with bf16 gradients, an fp32
                                  master and bf16 m, v (recipes differ: say which you mean;
                                  jaxscale's fp8 policies keep bf16 working weights: 16,
                                  or 12 with bf16 moments)

ZeRO over N_d data-parallel devices (Rajbhandari et al. 2020): stage 1 shards the optimizer
state, 2 also the gradients, 3 also the weights; mixed-adam per device: 16, 4 + 12/N_d,
2 + 14/N_d, 16/N_d (x Psi). Model parallelism (tp x pp) first divides Psi among its devices.

What the paper's Table 1 leaves out and a device still holds:
  gathered_layer  ZeRO-3 gathers each layer's weights before using it: one layer (the
                  largest) of 16-bit weights, whole on the device while it computes
                  (DeepSpeed's estimator allows 4 bytes x the largest layer for it).
  offload         ZeRO-Offload (Ren et al. 2021): the optimizer state (master, m, v) lives in
                  CPU memory and the CPU runs Adam; the device keeps weights and gradients.
`max_params` inverts the count: the largest Psi whose states fit a byte budget (Table 2).
`deepspeed_estimate` is DeepSpeed's own estimator (`estimate_zero2/3_model_states_mem_needs`),
labelled as such: ZeRO-2 as 4 + 16/N bytes, ZeRO-3 as 18/N + 4 x the largest layer, and a
1.5x buffer on CPU memory.
"""
from __future__ import annotations

from jaxscale.costmodel.shape import ShapeError

BUDGETS = {  # bytes per parameter: weights, gradients, optimizer state
    "mixed-adam": (2, 2, 12),
    "fp32-adam": (4, 4, 8),
    "bf16-moments": (2, 2, 8),
    "adam8bit": (2, 2, 6),
    "bf16": (2, 2, 4),
    "fp8": (1, 2, 8),
}
OFFLOAD = ("none", "optimizer")


def _check(budget: str, zero_stage: int, offload: str) -> None:
    if budget not in BUDGETS:
        raise ShapeError(f"unknown bytes-per-param budget {budget!r}; choose from "
                         f"{', '.join(BUDGETS)}")
    if zero_stage not in (0, 1, 2, 3):
        raise ShapeError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if offload not in OFFLOAD:
        raise ShapeError(f"unknown offload {offload!r}; choose from {', '.join(OFFLOAD)}")


def per_param(dp: int, zero_stage: int = 0, budget: str = "mixed-adam",
              offload: str = "none") -> dict[str, float]:
    """Device bytes per parameter of the model-parallel shard: weights, gradients, optimizer
    (0 when offloaded), and the CPU's share when offloaded."""
    _check(budget, zero_stage, offload)
    if dp < 1:
        raise ShapeError(f"dp must be >= 1, got {dp}")
    w, g, o = BUDGETS[budget]
    shard = lambda stage: dp if zero_stage >= stage else 1  # noqa: E731
    out = {"params": w / shard(3), "grads": g / shard(2), "optimizer": o / shard(1), "cpu": 0.0}
    if offload == "optimizer":
        out["cpu"], out["optimizer"] = out["optimizer"], 0.0
    out["device"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def state_memory(params: float, dp: int = 1, zero_stage: int = 0, budget: str = "mixed-adam",
                 offload: str = "none", model_parallel: int = 1,
                 largest_layer: float = 0.0) -> dict[str, float]:
    """Bytes per device of the model states: Psi / model_parallel parameters sharded by ZeRO
    over dp, plus ZeRO-3's gathered layer (largest_layer parameters of this tp shard, in the
    budget's weight bytes; only when dp > 1, else nothing is gathered)."""
    if not params > 0 or model_parallel < 1 or largest_layer < 0:
        raise ShapeError(f"need params > 0, model_parallel >= 1 and largest_layer >= 0, got "
                         f"{params}, {model_parallel}, {largest_layer}")
    c = per_param(dp, zero_stage, budget, offload)
    n = params / model_parallel
    gathered = BUDGETS[budget][0] * largest_layer if zero_stage == 3 and dp > 1 else 0.0
    out = {"params": c["params"] * n, "grads": c["grads"] * n, "optimizer": c["optimizer"] * n,
           "gathered_layer": gathered, "cpu": c["cpu"] * n}
    out["total"] = out["params"] + out["grads"] + out["optimizer"] + gathered
    return out


def max_params(device_bytes: float, dp: int = 1, zero_stage: int = 0,
               budget: str = "mixed-adam", offload: str = "none", model_parallel: int = 1,
               reserved: float = 0.0) -> float:
    """The largest Psi whose model states fit device_bytes - reserved on each device (the
    ZeRO paper's Table 2 inverts its Table 1 this way: activations and buffers left out)."""
    room = device_bytes - reserved
    if not room > 0:
        raise ShapeError(f"nothing left for model states: {device_bytes:.4g} bytes on the "
                         f"device, {reserved:.4g} reserved")
    return room * model_parallel / per_param(dp, zero_stage, budget, offload)["device"]


def deepspeed_estimate(params: float, largest_layer: float, gpus_per_node: int, nodes: int = 1,
                       zero_stage: int = 3, offload: str = "none",
                       buffer_factor: float = 1.5) -> dict[str, float]:
    """DeepSpeed's estimator, re-derived from its published formulas
    (deepspeed.runtime.zero: estimate_zero2_model_states_mem_needs and
    estimate_zero3_model_states_mem_needs with zero_init=True), N = gpus_per_node x nodes:

      ZeRO-2, none       GPU 4 Psi + 16 Psi / N         CPU 4 Psi x gpus_per_node x buffer
      ZeRO-2, optimizer  GPU 2 Psi                      CPU Psi x max(4 N, 16) x buffer
      ZeRO-3, none       GPU 4 largest + 18 Psi / N     CPU 4 largest x gpus_per_node x buffer
      ZeRO-3, optimizer  GPU 4 largest + 2 Psi / N      CPU 16 Psi / nodes x buffer
      ZeRO-3, params     GPU 4 largest                  CPU 18 Psi / nodes x buffer

    These are DeepSpeed's choices, not this module's: ZeRO-2 keeps 4 bytes of weights and
    gradients per parameter unsharded (16-bit weights plus a gradient buffer) where the ZeRO
    paper counts 2 + 14/N; ZeRO-3 counts 18 bytes sharded (an fp32 gradient copy) and 4 bytes
    x the largest layer for the gathered weights. DeepSpeed truncates to whole bytes (int).
    """
    n = gpus_per_node * nodes
    if not (params > 0 and largest_layer >= 0 and gpus_per_node >= 1 and nodes >= 1):
        raise ShapeError(f"need params > 0, largest_layer >= 0, gpus_per_node, nodes >= 1; got "
                         f"{params}, {largest_layer}, {gpus_per_node}, {nodes}")
    b = buffer_factor
    if zero_stage == 2:
        table = {"none": (4 * params + int(16 * params / n), params * 4 * gpus_per_node * b),
                 "optimizer": (2 * params, params * max(4 * n, 16) * b)}
    elif zero_stage == 3:
        layer = 4 * largest_layer
        table = {"none": (layer + int(18 * params / n), largest_layer * 4 * gpus_per_node * b),
                 "optimizer": (layer + int(2 * params / n), params * 16 / nodes * b),
                 "params": (layer, params * 18 / nodes * b)}
    else:
        raise ShapeError(f"DeepSpeed's estimator covers ZeRO stages 2 and 3, got {zero_stage!r}")
    if offload not in table:
        raise ShapeError(f"ZeRO-{zero_stage} offloads {', '.join(map(repr, table))}; got "
                         f"{offload!r}")
    gpu, cpu = table[offload]
    return {"gpu_per_device": float(gpu), "cpu_per_node": float(int(cpu))}
