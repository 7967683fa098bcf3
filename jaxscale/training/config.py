"""What defines a training run: `TrainConfig` (the parallel strategy included, as a Plan),
its validation, the learning-rate schedule and the optimizer it names."""
from __future__ import annotations

import math
from dataclasses import dataclass

import optax

from jaxscale.model import config as model_config, fp8, fp8_history, optim, precision
from jaxscale.model.optim_states import STATE_DTYPES, check_state_dtype, states_in
from jaxscale.parallel.fits import check_divisible
from jaxscale.parallel.plan import Plan
from jaxscale.training import spikes


class TrainConfigError(ValueError):
    """A training option is out of range."""


OPTIMIZERS = tuple(optim.OPTIMIZERS)
LR_SCHEDULES = ("cosine", "constant")


@dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a training run (the parallel strategy included, as a Plan)."""

    model: str = "tiny"
    steps: int = 1500
    optimizer: str = "adamw"
    lr: float = 1e-2
    lr_schedule: str = "cosine"
    warmup: int = 100
    batch_size: int = 32
    seed: int = 0
    eval_every: int = 100
    precision: str = "fp32"  # a policy of jaxscale.model.precision: fp32, bf16, fp16, bf16-pure
    optimizer_state_dtype: str = "fp32"  # fp32, or bf16: the optimizer's moments in bfloat16
    fp8_block: int = fp8.BLOCK  # precision fp8-block: its tile length
    fp8_head: bool = False  # an fp8 precision: the output head in FP8 too
    fp8_history: int = fp8_history.HISTORY  # precision fp8-delayed: steps of amax history
    mesh: str = "dp=1"  # device mesh of the parallel Plan, e.g. "dp=8"
    micro_batches: int = 1  # gradient accumulation: micro-batches per optimizer step
    remat: str = "none"  # activation recomputation: none, full, matmuls, selective
    attention: str = "einsum"  # attention kernel: einsum (reference), xla, cudnn (GPU)
    unroll: bool = False  # write the layers out instead of scanning one loop body
    zero_stage: int = 0  # ZeRO over the dp axis: 0 (plain data parallel), 1, 2, 3
    sequence_parallel: bool = False  # Megatron SP: the tp group also splits the sequence
    schedule: str = "1f1b"  # pipeline schedule (pp > 1): gpipe, 1f1b, interleaved
    virtual: int = 1  # model chunks per pipeline device (interleaved: >= 2)
    stop_gap: float | None = None  # stop once val loss - floor <= stop_gap (nats)
    spike_policy: str = "none"  # jaxscale.training.spikes: none, skip, rollback, stop
    spike_z: float = 6.0  # a spike: loss or grad norm above mean + z * std of the window
    spike_window: int = 50  # accepted steps in the rolling statistics (and the warm-up)
    rollback_lr_factor: float = 0.5  # a rollback scales the learning rate by this
    n_train_docs: int = 8192
    n_val_docs: int = 512

    def plan(self, validate: bool = True) -> Plan:
        """The parallel Plan of this run (validated against the batch size, unless not
        `validate`)."""
        plan = Plan.from_mesh(self.mesh, micro_batches=self.micro_batches, remat=self.remat,
                              zero_stage=self.zero_stage, precision=self.precision,
                              schedule=self.schedule, virtual=self.virtual,
                              attention=self.attention, unroll=self.unroll,
                              sequence_parallel=self.sequence_parallel,
                              fp8_block=self.fp8_block, fp8_head=self.fp8_head,
                              fp8_history=self.fp8_history)
        return plan.validate(global_batch=self.batch_size) if validate else plan

    def validate(self) -> None:
        model_config.preset(self.model)
        checks = [
            (self.steps >= 1, f"steps must be >= 1, got {self.steps}"),
            (self.optimizer in OPTIMIZERS,
             f"unknown optimizer {self.optimizer!r}; choose from {', '.join(OPTIMIZERS)}"),
            (math.isfinite(self.lr) and self.lr > 0, f"lr must be a positive number, got {self.lr}"),
            (self.lr_schedule in LR_SCHEDULES,
             f"unknown lr schedule {self.lr_schedule!r}; choose from {', '.join(LR_SCHEDULES)}"),
            (self.warmup >= 0, f"warmup must be >= 0 steps, got {self.warmup}"),
            (self.batch_size >= 1, f"batch size must be >= 1, got {self.batch_size}"),
            (self.eval_every >= 1, f"eval_every must be >= 1, got {self.eval_every}"),
            (self.stop_gap is None or self.stop_gap > 0,
             f"stop_gap must be a positive number of nats, got {self.stop_gap}"),
            (self.n_train_docs >= self.batch_size,
             f"n_train_docs={self.n_train_docs} is smaller than one batch ({self.batch_size})"),
            (self.n_val_docs >= 1, f"n_val_docs must be >= 1, got {self.n_val_docs}"),
            (self.precision in precision.POLICIES, f"unknown precision policy "
             f"{self.precision!r}; choose from {', '.join(precision.POLICIES)}"),
            (self.optimizer_state_dtype in STATE_DTYPES, "unknown optimizer state dtype "
             f"{self.optimizer_state_dtype!r}; choose from {', '.join(STATE_DTYPES)}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise TrainConfigError(msg)
        try:
            check_state_dtype(self.optimizer, self.optimizer_state_dtype)
        except ValueError as e:
            raise TrainConfigError(str(e)) from None
        try:
            spikes.check_options(self.spike_policy, self.spike_z, self.spike_window,
                                 self.rollback_lr_factor)
        except spikes.SpikeError as e:
            raise TrainConfigError(str(e)) from None
        plan = self.plan()
        check_divisible(model_config.preset(self.model), plan)  # (and fp8-block's tiles)

    def check_platform(self, platform: str) -> None:
        """Refuse to train a GPU/TPU-sized preset on CPU devices (before anything is built)."""
        try:
            model_config.check_platform(self.model, platform)
        except model_config.ModelConfigError as e:
            raise TrainConfigError(str(e)) from None


def warmup_steps(cfg: TrainConfig) -> int:
    """The warm-up the schedule uses: cfg.warmup, but at most half the run (the other half
    is the decay's)."""
    return min(cfg.warmup, cfg.steps // 2)


def lr_schedule(cfg: TrainConfig) -> optax.Schedule:
    """Linear warm-up to cfg.lr, then constant or cosine decay to 10% by the last step."""
    warmup = warmup_steps(cfg)
    if cfg.lr_schedule == "constant":
        return optax.linear_schedule(0.0, cfg.lr, warmup) if warmup else optax.constant_schedule(cfg.lr)
    return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, max(cfg.steps, warmup + 1),
                                              end_value=0.1 * cfg.lr)


# Training defaults per optimizer, on top of jaxscale.model.optim's (which equal optax's):
# AdamW as LLMs are usually pre-trained (b2 = 0.95, weight decay 0.1).
TRAIN_HYPERPARAMETERS = {"adamw": {"b2": 0.95, "weight_decay": 0.1}}


def make_optimizer(name: str, learning_rate, state_dtype: str = "fp32"
                   ) -> optax.GradientTransformation:
    """A hand-written optimizer from jaxscale.model.optim (bit-identical to its optax twin),
    its state kept in `state_dtype` (jaxscale.model.optim_states)."""
    if name not in OPTIMIZERS:
        raise TrainConfigError(f"unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}")
    return states_in(state_dtype, optim.make(name, learning_rate,
                                             **TRAIN_HYPERPARAMETERS.get(name, {})))
