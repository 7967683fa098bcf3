"""Peak FLOP/s of an accelerator: the datasheet figure, and one measured with a matmul loop.

Model FLOPs utilisation (MFU) divides the FLOP/s a training run achieves by the chip's
peak:  MFU = flops_per_token * tokens_per_s / peak_flops_per_s  (jaxscale.model.flops counts the
first factor). The peak comes from one of two places:

  DATASHEET            the vendor's dense figure per dtype (no 2:4 structured sparsity,
                       which doubles the headline number and which no training run uses).
                       The usual denominator of MFU; never reached in practice.
  measure_matmul_peak  the rate of one large square matmul, repeated, on this device: what
                       XLA's matmul actually reaches (on CPU, the only peak there is).

`datasheet_peak` refuses to guess: an unknown device, or a dtype the chip has no figure for
(bfloat16 on a V100, float16 on a TPU), gives None, never a neighbour's number.
"""
from __future__ import annotations

import math
import re
import statistics
import time
from dataclasses import asdict, dataclass

import jax
import jax.numpy as jnp

from jaxscale.costmodel.devices import PEAK_FLOPS as DATASHEET  # the one table of peaks

DTYPES = ("bfloat16", "float16", "float32", "tfloat32")

# JAX's device.device_kind -> DATASHEET key. The kind is split into lower-case words and
# the FIRST rule whose words are all present wins, so each specific rule comes before the
# general one it refines ("h100 pcie" before "h100", "tpu v5 lite" before "tpu v5").
# Whole words, so "a10" never matches "A100".
_RULES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("h100", "pcie"), "h100-pcie"), (("h100", "nvl"), "h100-nvl"), (("h100",), "h100-sxm"),
    (("h200", "nvl"), "h200-nvl"), (("h200",), "h200-sxm"),
    (("a100",), "a100"), (("a10g",), "a10"), (("a10",), "a10"), (("l4",), "l4"),
    (("v100", "pcie"), "v100-pcie"), (("v100",), "v100-sxm2"),
    (("tpu", "v4"), "tpu-v4"),
    (("tpu", "v5", "lite"), "tpu-v5e"), (("tpu", "v5e"), "tpu-v5e"),
    (("tpu", "v5p"), "tpu-v5p"), (("tpu", "v5"), "tpu-v5p"),
    (("tpu", "v6", "lite"), "tpu-v6e"), (("tpu", "v6e"), "tpu-v6e"),
)


def device_key(device_kind: str) -> str | None:
    """The DATASHEET key of a JAX device kind ("NVIDIA H100 80GB HBM3" -> "h100-sxm"), or
    None when no rule matches (CPUs, chips not in the table)."""
    words = set(re.split(r"[^a-z0-9]+", device_kind.lower()))
    return next((key for need, key in _RULES if words.issuperset(need)), None)


def dtype_name(dtype) -> str:
    """"bfloat16", "float16", "float32" or "tfloat32" for a name or a jnp/numpy dtype."""
    if isinstance(dtype, str) and dtype == "tfloat32":
        return "tfloat32"
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        name = str(dtype)
    if name not in DTYPES:
        raise ValueError(f"no peak figures for dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    return name


def datasheet_peak(device_kind: str, dtype) -> float | None:
    """Dense datasheet FLOP/s of `device_kind` (JAX's `device.device_kind`) in `dtype`;
    None for an unknown device or a dtype the chip has no figure for."""
    name = dtype_name(dtype)  # check the dtype first: a typo raises even on a CPU
    key = device_key(device_kind)
    return None if key is None else DATASHEET[key].get(name)


def mfu(flops_per_token: float, tokens_per_s: float,
        peak_flops_per_s: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak (None without a peak)."""
    if peak_flops_per_s is None:
        return None
    return flops_per_token * tokens_per_s / peak_flops_per_s


# --------------------------------------------------------------------------------------
# Measured: a chain of n x n matmuls
# --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MatmulPeak:
    """A measured matmul rate: `iters` chained n x n matmuls per call, median of repeats."""

    flops_per_s: float  # iters * 2 n^3 / seconds
    n: int
    dtype: str
    iters: int
    seconds: float  # median wall time of one call
    device_kind: str
    platform: str

    def as_dict(self) -> dict:
        return asdict(self)


def measure_matmul_peak(device=None, dtype=None, n: int | None = None,
                        iters: int | None = None, repeats: int = 5) -> MatmulPeak:
    """Time `iters` n x n matmuls, each feeding the next, on `device` (default: the first).

    Defaults: bfloat16, n = 8192, 20 iterations on GPU/TPU; float32, n = 1024, 4 iterations
    on CPU. On this project's 2-core CPU (float32, median of 5, runs repeated) n = 256 gave
    50-70 GFLOP/s, 512 80-95, 1024 110-135 and 2048 120-137 in twice the time: 1024 is the
    smallest n on the plateau, about 0.5-1 s in all (compile included).

    The data is random normal, made on the device (some hardware multiplies zeros faster).
    One jitted `fori_loop` runs x = (x @ w) * n^-1/2: every matmul needs the previous one's
    result, so XLA can neither drop nor merge them; the scale keeps the values bounded; and
    one dispatch per call amortises the launch cost. The first call compiles and warms up;
    then `repeats` calls are timed with block_until_ready and the median kept.
    """
    device = device or jax.devices()[0]
    accelerator = device.platform != "cpu"
    dtype = jnp.dtype(dtype or (jnp.bfloat16 if accelerator else jnp.float32))
    n = n or (8192 if accelerator else 1024)
    iters = iters or (20 if accelerator else 4)
    with jax.default_device(device):  # made there, and committed there (device_put)
        x, w = jax.device_put(jax.random.normal(jax.random.key(0), (2, n, n), dtype), device)
    scale = jnp.asarray(1 / math.sqrt(n), dtype)

    @jax.jit
    def chain(x, w):
        return jax.lax.fori_loop(0, iters, lambda _, x: (x @ w) * scale, x)

    chain(x, w).block_until_ready()  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        chain(x, w).block_until_ready()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    return MatmulPeak(flops_per_s=iters * 2 * n ** 3 / seconds, n=n, dtype=dtype.name,
                      iters=iters, seconds=seconds, device_kind=device.device_kind,
                      platform=device.platform)
