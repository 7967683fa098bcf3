"""Accelerators as the time model sees them: peak FLOP/s, memory, and the links between them.

PEAK_FLOPS is the datasheet's dense figure per dtype (jaxscale.measure.hardware reads it for MFU and
maps JAX device kinds onto its keys). DEVICES adds what a step-time estimate needs:

  memory     HBM bytes per device
  hbm        HBM bandwidth, bytes/s (the roofline: a matmul is compute-bound above
             peak / hbm FLOPs per byte)
  intra      bytes/s each device can send one way inside its node or torus slice: NVLink
             (per GPU, one direction) or one ICI link (one direction)
  inter      bytes/s each device sends one way to other nodes: InfiniBand per GPU, or DCN
             per TPU chip
  node_size  devices joined by `intra` (an HGX node; a TPU pod slice)
  bidirectional  True where collectives run on a torus ring that sends both ways at once
             (TPU ICI); False for GPUs, where a ring's step is limited by one direction of
             the device's injection bandwidth (NCCL's "bus bandwidth")
  latency    seconds per ring hop (about 1 us on ICI, the scaling book; a few us on NVLink)

Sources: NVIDIA datasheets and the JAX scaling book (jax-ml/scaling-book, tpus.md and gpus.md:
H100 NVLink 450 GB/s and 400 Gb/s NDR per GPU; A100 NVLink 300 GB/s and 200 Gb/s HDR per GPU
as in Narayanan et al. 2021's cluster; TPU ICI one-way per link and DCN per chip; v6e from
the Cloud TPU v6e page). A TPU chip's memory is jaxscale.runtime.targets' (one table).
`device` refuses a name not in the table rather than assume a neighbour's figures.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from jaxscale.runtime import targets

T = 1e12
# Dense peak FLOP/s per dtype. "tfloat32" is the tensor-core rate of float32 matmuls on
# Ampere and later (taken when matmul precision allows it); "float32" is the plain rate.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    # NVIDIA H100 datasheet, SXM, dense (the sheet prints bf16/fp16 1979 and tf32 989 *with
    # sparsity*; half of those here)
    "h100-sxm": {"bfloat16": 989 * T, "float16": 989 * T, "tfloat32": 494.5 * T, "float32": 67 * T},
    # NVIDIA H100 datasheet, PCIe, dense
    "h100-pcie": {"bfloat16": 756 * T, "float16": 756 * T, "tfloat32": 378 * T, "float32": 51 * T},
    # NVIDIA H100 datasheet, NVL, dense
    "h100-nvl": {"bfloat16": 835.5 * T, "float16": 835.5 * T, "tfloat32": 417.5 * T, "float32": 60 * T},
    # NVIDIA H200 datasheet, SXM, dense (same compute as H100 SXM, more and faster memory)
    "h200-sxm": {"bfloat16": 989 * T, "float16": 989 * T, "tfloat32": 494.5 * T, "float32": 67 * T},
    # NVIDIA H200 datasheet, NVL, dense
    "h200-nvl": {"bfloat16": 835.5 * T, "float16": 835.5 * T, "tfloat32": 417.5 * T, "float32": 60 * T},
    # NVIDIA A100 datasheet, dense (SXM and PCIe, 40 and 80 GB alike)
    "a100": {"bfloat16": 312 * T, "float16": 312 * T, "tfloat32": 156 * T, "float32": 19.5 * T},
    # NVIDIA L4 datasheet, dense (the sheet prints 242 / 120 with sparsity)
    "l4": {"bfloat16": 121 * T, "float16": 121 * T, "tfloat32": 60 * T, "float32": 30.3 * T},
    # NVIDIA A10 datasheet, dense. A10G is AWS's variant; NVIDIA publishes no sheet for it,
    # so it shares these figures.
    "a10": {"bfloat16": 125 * T, "float16": 125 * T, "tfloat32": 62.5 * T, "float32": 31.2 * T},
    # NVIDIA V100 datasheet, SXM2 and PCIe (Volta: fp16 tensor cores, no bfloat16, no tf32)
    "v100-sxm2": {"float16": 125 * T, "float32": 15.7 * T},
    "v100-pcie": {"float16": 112 * T, "float32": 14 * T},
    # Google Cloud TPU system architecture pages, bf16 peak per chip (the MXU has no
    # published float16 or float32 rate)
    "tpu-v4": {"bfloat16": 275 * T},
    "tpu-v5e": {"bfloat16": 197 * T},
    "tpu-v5p": {"bfloat16": 459 * T},
    "tpu-v6e": {"bfloat16": 918 * T},  # Trillium
}


@dataclass(frozen=True)
class Device:
    name: str
    peak: float  # dense bf16 FLOP/s
    memory: float  # bytes
    hbm: float  # bytes/s
    intra: float  # bytes/s one way per device
    inter: float  # bytes/s one way per device
    node_size: int
    bidirectional: bool
    latency: float  # seconds per hop

    def as_dict(self) -> dict:
        return asdict(self)


G = 1e9
# Memory per device. A TPU chip's HBM is the compile targets' (jaxscale.runtime.targets,
# from the Cloud TPU pages), so that `plan --verify --target` sets the planner's memory and
# XLA:TPU's against the same chip. The GPUs keep the datasheets' nominal 80 / 141 GB; the
# GPU compile targets use what XLA's target spec gives (84.9e9 and 151.4e9 bytes: the
# driver's figure), a margin of 6-7% the planner keeps.
TPU_HBM = {gen: hbm for gen, (hbm, _, _) in targets.GENERATIONS.items()}
DEVICES = {
    "a100": Device("a100", PEAK_FLOPS["a100"]["bfloat16"], 80 * G, 2.039e12, 300 * G, 25 * G,
                   8, False, 5e-6),
    "h100": Device("h100", PEAK_FLOPS["h100-sxm"]["bfloat16"], 80 * G, 3.35e12, 450 * G,
                   50 * G, 8, False, 5e-6),
    "h200": Device("h200", PEAK_FLOPS["h200-sxm"]["bfloat16"], 141 * G, 4.8e12, 450 * G,
                   50 * G, 8, False, 5e-6),
    # v4 has no compile target (its compile-only devices are TensorCores): its page's 32 GiB
    "tpu-v4": Device("tpu-v4", PEAK_FLOPS["tpu-v4"]["bfloat16"], 32 * 2**30, 1.2e12, 4.5e10,
                     6.25e9, 4096, True, 1e-6),
    "tpu-v5e": Device("tpu-v5e", PEAK_FLOPS["tpu-v5e"]["bfloat16"], TPU_HBM["v5e"], 8.1e11,
                      4.5e10, 3.125e9, 256, True, 1e-6),
    "tpu-v5p": Device("tpu-v5p", PEAK_FLOPS["tpu-v5p"]["bfloat16"], TPU_HBM["v5p"], 2.8e12,
                      9e10, 6.25e9, 8960, True, 1e-6),
    # Trillium: HBM 1.6 TB/s; ICI twice v5e's per link; DCN 25.6 Tb/s per 256-chip pod
    "tpu-v6e": Device("tpu-v6e", PEAK_FLOPS["tpu-v6e"]["bfloat16"], TPU_HBM["v6e"], 1.6e12,
                      9e10, 1.25e10, 256, True, 1e-6),
}


class UnknownDevice(ValueError):
    """A device name the table does not have."""


def device(name: str) -> Device:
    """The table's entry for `name` (case-insensitive); an unknown name lists the known."""
    key = str(name).lower()
    if key not in DEVICES:
        raise UnknownDevice(f"unknown device {name!r}; choose from {', '.join(DEVICES)}")
    return DEVICES[key]


def matmul_critical_batch(dev: Device) -> float:
    """Tokens per matmul above which a bf16 matmul is compute-bound: peak / HBM bandwidth
    (intensity of [B, D] x [D, F] is about B FLOPs per byte when B << D, F)."""
    return dev.peak / dev.hbm


def comm_critical_batch(dev: Device, bandwidth: float) -> float:
    """Tokens per device above which data parallelism (or FSDP) hides its gradient reduction
    behind compute: peak / bandwidth (the scaling book's C / W; W both directions on ICI)."""
    return dev.peak / bandwidth
