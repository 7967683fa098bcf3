"""How fast one training step runs, and how close that comes to the hardware (MFU).

    tokens/s     batch x seq_len / step time: every position computed, padding included
                 (a tiny or small garden row is one document, about a third of 64
                 positions; packed rows, mid and up, are full)
    step time    median over `steps` timed steps, after compiling and `warmup` steps
    MFU          model FLOPs per token (jaxscale.model.flops: 6N + 12 L s d) x tokens/s, over
                 (a) the device's datasheet peak for the compute dtype (jaxscale.measure.hardware)
                 (b) a matmul peak measured on the same device in the same run: what this
                     machine really sustains on one large matmul, so a CPU (no datasheet)
                     gets an honest yardstick too

XLA's own count of the compiled step (`xla_flops_per_token`) is shown beside the analytic
one: with the layers scanned it sees one layer's loop body (a while loop is counted once),
unrolled all of them, and a custom call (cuDNN attention) as nothing.

The step is the one `jaxscale train` runs (Plan on one device: precision, remat, attention
kernel, scan or unroll) on a fixed garden batch: the data does not change the time.

`run_abstract` times nothing: it compiles the same step on abstract state for a device that
need not be there (one chip of a compile-only target, jaxscale.runtime.targets) and gives
what the compiler knows before the chip is paid for: the memory the step needs against the
chip's HBM, and the floor under its step time, the model's FLOPs at the datasheet peak.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxscale.model import flops as flopslib, transformer as modellib, precision
from jaxscale import garden
from jaxscale.measure import hardware, memory, timing
from jaxscale.runtime import profiling, target_cache
from jaxscale.parallel.plan import Plan
from jaxscale.parallel.build import build_train_step
from jaxscale.model import config as model_config
from jaxscale.training.config import make_optimizer


class BenchError(ValueError):
    """A benchmark option is out of range."""


@dataclass(frozen=True)
class BenchConfig:
    """One configuration to time."""

    model: str = "tiny"
    batch_size: int = 8
    precision: str = "fp32"
    remat: str = "none"
    attention: str = "einsum"
    unroll: bool = False
    steps: int = 10  # timed steps (the median is reported)
    warmup: int = 2  # steps run and not timed, after the compile

    def plan(self) -> Plan:
        return Plan(precision=self.precision, remat=self.remat, attention=self.attention,
                    unroll=self.unroll).validate(global_batch=self.batch_size)

    def validate(self) -> None:
        model_config.preset(self.model)
        for name in ("batch_size", "steps"):
            if getattr(self, name) < 1:
                raise BenchError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise BenchError(f"warmup must be >= 0 steps, got {self.warmup}")
        self.plan()


@dataclass
class BenchResult:
    """What `run` measured for one BenchConfig (every figure `jaxscale bench` prints)."""

    config: BenchConfig
    device_kind: str
    platform: str
    compile_s: float
    step_s: float  # median
    step_s_all: list[float]
    tokens_per_s: float
    flops: flopslib.FlopCount
    achieved_flops_per_s: float  # model FLOPs (non-causal convention) per second
    compute_dtype: str
    datasheet_peak: float | None
    mfu_datasheet: float | None
    matmul_peak: float | None
    mfu_matmul: float | None
    mfu_causal_datasheet: float | None
    xla_flops_per_token: float | None
    memory: dict  # this step's bytes per device, from XLA's memory analysis of the program
    allocator_peak_bytes: int | None  # the device allocator's peak so far in this process
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        out = asdict(self)
        out["flops"] = self.flops.as_dict()
        return out


def _batch(cfg: model_config.ModelConfig, batch_size: int) -> dict:
    """`batch_size` garden rows of cfg.seq_len (packed from PACK_FROM on), drawn once."""
    per_row = max(1, (cfg.seq_len + 1) // 20)  # documents average 22 tokens
    docs = max(batch_size * per_row * 2, 64)
    corpus = garden.corpus_for(cfg.seq_len, seed=0, n_train=docs, n_val=1)
    rows = [corpus.train[i % len(corpus.train)] for i in range(batch_size)]
    b = garden.make_batch(rows, cfg.seq_len)
    return {"tokens": b.tokens, "targets": b.targets, "mask": b.mask}


def peak_dtype(dtype, platform: str) -> str:
    """The datasheet column a step in `dtype` runs at: float32 matmuls on an NVIDIA GPU
    run on the tensor cores as TF32 under XLA's default matmul precision."""
    name = np.dtype(dtype).name
    return "tfloat32" if name == "float32" and platform == "gpu" else name


def _allocator_peak(device) -> int | None:
    """The allocator's peak since the process started (GPU, TPU); None on CPU, which has
    no such count. With several rows in one process it is the largest row's so far: the
    row's own figure is `memory` (XLA's analysis of its program)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return None if not stats else stats.get("peak_bytes_in_use")


def run(cfg: BenchConfig, device=None, matmul_peak: hardware.MatmulPeak | None = None,
        profiler=None) -> BenchResult:
    """Compile, warm up and time cfg's step on `device` (default: the first device).
    `matmul_peak`: measured once per run and shared by its rows. `profiler`
    (jaxscale.runtime.profiling.Profiler): the timed steps are traced, compile and warm-up not."""
    cfg.validate()
    device = device or jax.devices()[0]
    mcfg = model_config.preset(cfg.model)
    plan = cfg.plan()
    optimizer = make_optimizer("adamw", 1e-4)
    init, step = build_train_step(mcfg, plan, optimizer, [device])
    with jax.default_device(device):
        params = nnx.to_pure_dict(nnx.state(modellib.build(mcfg, seed=0), nnx.Param))
        state = init(params)
        batch = jax.device_put(_batch(mcfg, cfg.batch_size), device)
    t0 = time.perf_counter()
    compiled = step.jitted.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    xla = flopslib.xla_flops(compiled)
    for _ in range(cfg.warmup):
        state, m = compiled(state, batch)
    jax.block_until_ready(state)
    times = []
    profiler = profiler or profiling.Profiler(None)
    with profiler.trace():
        for i in range(cfg.steps):
            with profiler.step(i):
                t = time.perf_counter()
                state, m = compiled(state, batch)
                jax.block_until_ready(m)
                times.append(time.perf_counter() - t)
    step_s = statistics.median(times)
    tokens = cfg.batch_size * mcfg.seq_len
    count = flopslib.model_flops_per_token(mcfg)
    rate = tokens / step_s
    dtype = precision.policy(cfg.precision).compute_dtype
    peak = hardware.datasheet_peak(device.device_kind, peak_dtype(dtype, device.platform))
    mm = None if matmul_peak is None else matmul_peak.flops_per_s
    return BenchResult(
        cfg, device.device_kind, device.platform, compile_s, step_s, times, rate, count,
        count.total * rate, np.dtype(dtype).name, peak, hardware.mfu(count.total, rate, peak),
        mm, hardware.mfu(count.total, rate, mm), hardware.mfu(count.total_causal, rate, peak),
        None if xla is None else xla / tokens, memory.memory(compiled), _allocator_peak(device))


def run_abstract(cfg: BenchConfig, device, hbm_bytes: float | None = None,
                 target=None) -> dict:
    """Compile cfg's step for `device` on abstract state (nothing allocated, nothing run):
    the compiler's memory per device (what it must hold: arguments, outputs not aliased to
    them, temporaries, generated code) against `hbm_bytes`, and the step's floor: the
    model's FLOPs (jaxscale.model.flops, non-causal convention) at the datasheet peak, the
    time at 100% MFU. A step the compiler refuses for memory gives its own sentence. With
    the `target` (runtime.targets.Target) `device` belongs to, a program compiled before
    for it is read back (runtime.target_cache; compile_source "cache")."""
    cfg.validate()
    mcfg = model_config.preset(cfg.model)
    init, step = build_train_step(mcfg, cfg.plan(), make_optimizer("adamw", 1e-4), [device])
    here = jax.sharding.SingleDeviceSharding(device)  # a plain jit compiles where they live
    on = lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=here)  # noqa: E731
    params = nnx.to_pure_dict(nnx.state(modellib.abstract(mcfg), nnx.Param))
    state = jax.tree.map(on, jax.eval_shape(init, params))
    batch = {k: on(jax.ShapeDtypeStruct((cfg.batch_size, mcfg.seq_len), dtype))
             for k, dtype in (("tokens", jnp.int32), ("targets", jnp.int32),
                              ("mask", jnp.float32))}
    count = flopslib.model_flops_per_token(mcfg)
    dtype = precision.policy(cfg.precision).compute_dtype
    peak = hardware.datasheet_peak(device.device_kind, peak_dtype(dtype, device.platform))
    tokens = cfg.batch_size * mcfg.seq_len
    row = {"config": asdict(cfg), "device_kind": device.device_kind,
           "platform": device.platform, "hbm_bytes": hbm_bytes,
           "flops_per_token": count.total, "compute_dtype": np.dtype(dtype).name,
           "datasheet_peak": peak, "step_s_at_peak": tokens * count.total / peak if peak else None,
           "tokens_per_s_at_peak": peak / count.total if peak else None}
    t0 = time.perf_counter()
    try:
        lowered = step.jitted.lower(state, batch)
        if target is None:  # this machine's device: jax's own cache may supply it
            compiled, _, source = timing.compile_timed(lowered)
        else:
            compiled, source = target_cache.compile_for(lowered, target)
    except jax.errors.JaxRuntimeError as e:
        why = memory.refusal(e)
        if why is None:
            raise
        return {**row, **memory.refused_bytes(why), "compile_s": time.perf_counter() - t0,
                "compile_source": getattr(e, "compile_source", "compiled"),
                "memory": None, "generated_code": None, "needed_bytes": None, "fits": False,
                "refused": why, "xla_flops_per_token": None}
    mem = memory.memory(compiled)
    needed, code = memory.needed_bytes(compiled, mem)
    xla = flopslib.xla_flops(compiled)
    return {**row, "compile_s": time.perf_counter() - t0, "compile_source": source, "memory": mem,
            "refused_needed_bytes": None, "refused_available_bytes": None,
            "generated_code": code, "needed_bytes": needed,
            "fits": None if hbm_bytes is None else needed <= hbm_bytes, "refused": None,
            "xla_flops_per_token": None if xla is None else xla / tokens}
