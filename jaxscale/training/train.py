"""Training: the plain reference step, and the loop that runs any parallel Plan.

`make_train_step` is the plain single-device fp32 step, the reference everything else is
checked against. The loop `train` builds its step with `parallel.plan.build_train_step`
from the config's Plan (mesh, micro-batches, precision, remat); for `Plan()` with fp32 that
step is bit-identical to the plain one. The loss lives in `jaxscale.model.loss`.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxscale.runtime import processes as distributed, profiling
from jaxscale import garden
from jaxscale.model import transformer as modellib, optim, precision
from jaxscale.training import spikes
from jaxscale.training.checkpoint.manager import Checkpointer, CheckpointOptions, run_meta
from jaxscale.data.sampler import StepBatches
from jaxscale.model.loss import loss_fn, nll_and_count  # noqa: F401  (re-exported)
from jaxscale.parallel.plan import Plan
from jaxscale.parallel.build import build_train_step
from jaxscale.report import Progress, plot_loss_curve
from jaxscale.model import config as model_config
from jaxscale.parallel import step as steplib


class TrainConfigError(ValueError):
    """A training option is out of range."""


class TrainInterrupted(KeyboardInterrupt):
    """Ctrl-C during `train`: the metrics so far and a partial result are written; `result`
    holds the steps that ran. A KeyboardInterrupt still, so callers stop as they would."""

    def __init__(self, result: "TrainResult"):
        super().__init__(f"interrupted after {result.steps_run} steps")
        self.result = result


OPTIMIZERS = tuple(optim.OPTIMIZERS)
PROFILE_STEPS = 10  # steps a --profile trace holds (more make files of many megabytes)
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
                              sequence_parallel=self.sequence_parallel)
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
        ]
        for ok, msg in checks:
            if not ok:
                raise TrainConfigError(msg)
        try:
            spikes.check_options(self.spike_policy, self.spike_z, self.spike_window,
                                 self.rollback_lr_factor)
        except spikes.SpikeError as e:
            raise TrainConfigError(str(e)) from None
        plan = self.plan()
        if plan.tp > 1 or plan.pp > 1:
            from jaxscale.parallel.hybrid import check_divisible
            check_divisible(model_config.preset(self.model), plan)

    def check_platform(self, platform: str) -> None:
        """Refuse to train a GPU/TPU-sized preset on CPU devices (before anything is built)."""
        try:
            model_config.check_platform(self.model, platform)
        except model_config.ModelConfigError as e:
            raise TrainConfigError(str(e)) from None


def lr_schedule(cfg: TrainConfig) -> optax.Schedule:
    """Linear warm-up to cfg.lr, then constant or cosine decay to 10% by the last step."""
    warmup = min(cfg.warmup, cfg.steps // 2)
    if cfg.lr_schedule == "constant":
        return optax.linear_schedule(0.0, cfg.lr, warmup) if warmup else optax.constant_schedule(cfg.lr)
    return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, max(cfg.steps, warmup + 1),
                                              end_value=0.1 * cfg.lr)


# Training defaults per optimizer, on top of jaxscale.model.optim's (which equal optax's):
# AdamW as LLMs are usually pre-trained (b2 = 0.95, weight decay 0.1).
TRAIN_HYPERPARAMETERS = {"adamw": {"b2": 0.95, "weight_decay": 0.1}}


def make_optimizer(name: str, learning_rate) -> optax.GradientTransformation:
    """A hand-written optimizer from jaxscale.model.optim (bit-identical to its optax twin)."""
    if name not in OPTIMIZERS:
        raise TrainConfigError(f"unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}")
    return optim.make(name, learning_rate, **TRAIN_HYPERPARAMETERS.get(name, {}))


# --------------------------------------------------------------------------------------
# Loss and step
# --------------------------------------------------------------------------------------

def make_train_step(graphdef, optimizer: optax.GradientTransformation):
    """A jitted step(params, opt_state, batch) -> (params, opt_state, metrics)."""

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(graphdef, p, batch))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads),
                   "n_tokens": jnp.sum(batch["mask"])}
        return params, opt_state, metrics

    return step


def make_eval_step(graphdef):
    """A jitted function batch -> (sum NLL, token count), for validation."""
    return jax.jit(lambda params, batch: nll_and_count(graphdef, params, batch))


def as_arrays(batch: garden.Batch) -> dict[str, np.ndarray]:
    return {"tokens": batch.tokens, "targets": batch.targets, "mask": batch.mask}


def evaluate(eval_step, params, batches: list[garden.Batch]) -> float:
    """Validation loss: total NLL over all validation tokens / their count."""
    total = count = 0.0
    for b in batches:
        s, c = eval_step(params, as_arrays(b))
        total += float(s)
        count += float(c)
    return total / count


# --------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------

@dataclass
class TrainResult:
    """Every figure of a run; `to_json()` is what `jaxscale train --json` prints."""

    config: dict
    param_count: int
    entropy_floor: float
    loss_curve: list[float]
    grad_norms: list[float]
    val_curve: list[tuple[int, float]]
    val_loss: float
    steps_run: int
    tokens_seen: int
    compile_s: float  # wall time of the first step, dominated by compilation
    train_s: float
    tokens_per_s: float
    loss_scale: float  # at the end (1.0 without loss scaling)
    skipped_steps: int  # updates skipped for non-finite gradients (dynamic loss scaling)
    reached_gap_at_s: float | None  # wall seconds from start of training to val gap <= stop_gap
    nonfinite_step: int | None = None  # the step whose loss was NaN or inf; training stopped
    interrupted: bool = False  # Ctrl-C: the steps that ran, no final validation
    halted: bool = False  # stopped by halt_after (as if interrupted; the checkpoint resumes it)
    resumed_from: int | None = None  # the checkpoint step this run continued from
    spike_events: list = field(default_factory=list)  # the guard's events (jaxscale.training.spikes)
    rollbacks: int = 0  # spike rollbacks to a checkpoint
    steps_computed: int = 0  # steps this process ran, the ones rollbacks undid included

    @property
    def gap(self) -> float:
        return self.val_loss - self.entropy_floor

    def to_json(self) -> dict:
        """Every field and the gap; NaN and inf become null (JSON has no such numbers)."""
        d = asdict(self)
        d["gap"] = self.gap
        return _json_ready(d)


def _json_ready(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_ready(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_ready(v) for v in x]
    return x


def init_state(cfg: TrainConfig):
    """(graphdef, params, optimizer) for a fresh run of `cfg`.

    `graphdef` is the model's static structure; `params` the fp32 arrays as a nested dict.
    The optimizer state is built by the Plan's init, in the layout its strategy needs.
    """
    mcfg = model_config.preset(cfg.model)
    # validation runs this graph on fp32 parameters, which cuDNN's kernel does not take
    kernel = "xla" if cfg.attention == "cudnn" else cfg.attention
    model = modellib.build(mcfg, seed=cfg.seed, attention=kernel, unroll=cfg.unroll)
    graphdef, state = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(state)  # a plain nested dict of arrays; nnx.merge accepts it
    optimizer = make_optimizer(cfg.optimizer, lr_schedule(cfg))
    return graphdef, params, optimizer


def train(cfg: TrainConfig, out_dir: str | Path | None = None, progress: bool = True,
          log=None, checkpoint: CheckpointOptions | None = None,
          halt_after: int | None = None, faults=(),
          corpus: garden.Corpus | None = None, profile: str | Path | None = None) -> TrainResult:
    """Train on the garden corpus; write metrics.jsonl, loss_curve.png, result.json into out_dir.

    `corpus` replaces the one cfg describes (make_corpus(cfg.seed, cfg.n_train_docs, ...)):
    the data experiment trains on a duplicated and a deduplicated set this way. Its
    seq_len must be the model's; a checkpoint records the data position, not the corpus.
    `profile`: a jax.profiler trace of PROFILE_STEPS steps after the first (which compiles)
    goes to that folder (jaxscale.runtime.profiling; process 0 only).

    `checkpoint` saves the state every so many steps (and at the last) and, with resume,
    continues from the latest complete checkpoint under this config's plan, whichever plan
    wrote it (jaxscale.training.checkpoint.manager); `halt_after` stops after that step as if interrupted,
    keeping the schedule of all cfg.steps, so that a later run can resume it.

    cfg.spike_policy guards every step against loss spikes (jaxscale.training.spikes); `faults`
    (spikes.Fault) provoke them, and crashes, on purpose. Every guard event is a line of
    metrics.jsonl and an entry of result.spike_events.

    Under several processes (jax.distributed) every process runs this loop over one global
    mesh, each building only its own rows of every batch (data.sampler); only process 0
    shows progress and writes, and the stop decisions are process 0's, broadcast.
    Without a guard, a NaN or inf loss stops training at that step (result.nonfinite_step
    says which); with one, that step is skipped. Ctrl-C stops training too: metrics.jsonl
    and a result.json with "interrupted": true are written, then TrainInterrupted (a
    KeyboardInterrupt) is raised with the partial result.
    """
    cfg.validate()
    cfg.check_platform(jax.default_backend())
    if cfg.spike_policy == "rollback" and (checkpoint is None or checkpoint.every is None):
        raise TrainConfigError("spike policy rollback restores the last checkpoint: give a "
                               "checkpoint directory and a save interval (--checkpoint-dir, "
                               "--checkpoint-every), or use --spike-policy skip")
    mcfg = model_config.preset(cfg.model)
    if corpus is None:  # long rows hold several whole documents (garden.corpus_for)
        corpus = garden.corpus_for(mcfg.seq_len, cfg.seed, cfg.n_train_docs, cfg.n_val_docs)
        if len(corpus.train) < cfg.batch_size:
            raise TrainConfigError(
                f"{cfg.n_train_docs:,} documents pack into {len(corpus.train)} rows of "
                f"{mcfg.seq_len} tokens, fewer than one batch ({cfg.batch_size}); draw more "
                "documents (n_train_docs) or use a smaller batch")
    elif corpus.seq_len != mcfg.seq_len or len(corpus.train) < cfg.batch_size:
        raise TrainConfigError(f"the corpus given has seq_len {corpus.seq_len} and "
                               f"{len(corpus.train)} documents; model {cfg.model} needs "
                               f"seq_len {mcfg.seq_len} and at least one batch "
                               f"({cfg.batch_size})")
    floor = corpus.entropy_floor
    val_batches = corpus.val_batches(cfg.batch_size * 4)
    graphdef, params, optimizer = init_state(cfg)
    plan = cfg.plan()
    init_fn, step_fn = build_train_step(mcfg, plan, optimizer)
    eval_fn = make_eval_step(graphdef)
    whole = step_fn.full_params  # whole parameters for evaluation, from any layout
    main = distributed.is_main()  # one voice: only process 0 prints and writes
    progress = progress and main
    log = log if main else None
    note = log or (lambda msg, kind="warning": None)
    batches = StepBatches(corpus.train, cfg.batch_size, mcfg.seq_len, cfg.seed)
    losses, norms, val_curve = [], [], []
    tokens = start = 0
    # the guarded step when it has something to do; else the plain one, not a bit apart
    guarded = cfg.spike_policy != "none" or any(f.kind in ("nan", "lr") for f in faults)
    gs = spikes.GuardState()
    fault_log = spikes.FaultLog(faults, None if checkpoint is None else
                                Path(checkpoint.directory) / spikes.FAULTS_FILE, write=main)
    ckpt = None if checkpoint is None else Checkpointer(checkpoint, log)
    prof = profiling.Profiler(profile if main else None)

    def restore():
        """The latest checkpoint's step, state (resharded into this plan) and meta."""
        step, canonical, meta = ckpt.restore(step_fn.canonical, asdict(cfg))
        return step, step_fn.canonical.from_canonical(canonical), meta

    try:  # the checkpointer's threads are released if anything before the loop fails
        if ckpt is not None and checkpoint.resume:
            start, state, meta = restore()
            losses, norms, val_curve, tokens, gs = _resumed_metrics(meta)
            note(f"resumed from {ckpt.directory / str(start)} (saved under "
                 f"{meta['plan_layout']} on {meta['processes']} process(es)), now under "
                 f"{plan.layout()}", "note")
        else:
            state = init_fn(params)
        if halt_after is not None and not start < halt_after:
            raise TrainConfigError(f"halt_after={halt_after} must come after the step this "
                                   f"run starts from ({start})")
        out = Path(out_dir) if out_dir is not None and main else None
        jsonl = None
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            jsonl = _open_metrics(out / "metrics.jsonl", start)
    except BaseException:
        if ckpt is not None:
            ckpt.close()
        raise
    # a run that had already reached its stop gap when it was saved does not train on
    reached_before = (cfg.stop_gap is not None and bool(val_curve)
                      and val_curve[-1][1] - floor <= cfg.stop_gap)
    end = start if reached_before else cfg.steps
    window = spikes.Window.rebuild(cfg.spike_window, cfg.spike_z, losses, norms, set(gs.rejected))

    def write(record):
        if jsonl is not None:
            jsonl.write(json.dumps(_json_ready(record)) + "\n")

    schedule = lr_schedule(cfg)
    bar = Progress(cfg.steps, progress, label="train")
    if start:
        bar.update(start, f"resumed at step {start}")
    t_start = time.perf_counter()
    compile_s, reached_at, norm_median = 0.0, None, None
    nonfinite_at, interrupted, halted, tokens_before = None, False, False, tokens
    in_a_row, step, steps_run = 0, start, 0  # steps_run: every step computed, rollbacks too
    try:
        while step < end:
            step += 1
            data_step = step - 1 + gs.data_offset  # rollbacks skip batches: data runs ahead
            due = fault_log.due(step)
            for f in due:
                gs.events.append({"step": step, "event": "inject", "fault": str(f)})
                write(gs.events[-1])
                note(f"step {step}: injecting fault {f}", "note")
                if f.kind == "crash":
                    spikes.crash()
                if f.kind == "lr":
                    gs.lr_factor *= float(f.arg)
            bad = next((f for f in due if f.kind == "spike"), None)
            if bad is None:
                batch = batches.place(data_step, step_fn.batch_sharding)  # this process's rows
                n_tokens = batches.n_tokens(data_step)
            else:
                batch = spikes.bad_batch(bad.arg, cfg.batch_size, mcfg.seq_len, mcfg.vocab_size,
                                         cfg.seed, step, step_fn.batch_sharding)
                n_tokens = cfg.batch_size * mcfg.seq_len
            guard = None
            if guarded:
                loss_max, norm_max = (window.limits() if cfg.spike_policy != "none"
                                      else (math.inf, math.inf))
                guard = steplib.Guard.make(loss_max, norm_max, gs.lr_factor)
            if any(f.kind == "nan" for f in due):
                batch = spikes.poison(batch)
            t0 = time.perf_counter()
            with prof.step(step):
                state, m = step_fn(state, batch, guard)
                m = jax.device_get(m)  # waits for the step; one transfer for all metrics
            loss, gnorm = float(m["loss"]), float(m["grad_norm"])
            if steps_run == 0:
                compile_s = time.perf_counter() - t0
            steps_run += 1
            if steps_run == 1:  # compiled: trace the next PROFILE_STEPS steps
                prof.start()
            elif steps_run == 1 + PROFILE_STEPS and prof.running:
                prof.stop()
            losses.append(loss)
            norms.append(gnorm)
            tokens += n_tokens
            record = {"step": step, "batch": data_step, "wall": time.time(),
                      "loss": loss, "grad_norm": gnorm,
                      "n_tokens": n_tokens, "lr": float(schedule(step - 1)) * gs.lr_factor,
                      "loss_scale": float(m["loss_scale"]), "skipped": int(m["skipped"]),
                      "time_s": time.perf_counter() - t_start}
            action = None
            if bool(m["accepted"]):
                in_a_row = 0
                window.add(loss, gnorm)
                if not math.isfinite(loss):  # unguarded and diverged: every later step too
                    nonfinite_at = step
                # the gradient norm warns of a loss spike before the loss does
                elif (cfg.spike_policy == "none" and norm_median is not None
                      and gnorm > 5 * norm_median):
                    note(f"step {step}: gradient norm {gnorm:.3g} is "
                         f"{gnorm / norm_median:.1f}x its recent median (possible loss spike)")
                norm_median = float(np.median(norms[-50:]))
            else:
                action, event = _reject(cfg, ckpt, step, loss, gnorm, guard, note)
                in_a_row += 1
                gs.rejected.append(step)
                gs.events.append(event)
                record.update(event=event["event"], action=action)
            if nonfinite_at is None and (step % cfg.eval_every == 0 or step == cfg.steps):
                val = evaluate(eval_fn, whole(state), val_batches)
                val_curve.append((step, val))
                record.update(val_loss=val, entropy_floor=floor, gap=val - floor)
                if cfg.stop_gap is not None and val - floor <= cfg.stop_gap and reached_at is None:
                    reached_at = time.perf_counter() - t_start
            write(record)
            elapsed = time.perf_counter() - t_start - compile_s
            rate = (tokens - tokens_before) / elapsed if elapsed > 0 and steps_run > 1 else 0.0
            gap_txt = f" gap {val_curve[-1][1] - floor:.3f}" if val_curve else ""
            bar.update(step, f"loss {loss:.3f}{gap_txt} | {rate:,.0f} tok/s")
            if action == "rollback":
                ckpt.wait()  # an asynchronous save in flight is the latest checkpoint
                step, state, meta = restore()
                losses, norms, val_curve, tokens_at, saved = _resumed_metrics(meta)
                tokens_before += tokens_at - tokens  # the rate counts the steps computed
                tokens = tokens_at
                skipped = [step + saved.data_offset, data_step]  # data indices, inclusive
                # the rate is lowered from where it stood at the spike, not from the
                # checkpoint's: one saved after a bad update would restore it unchanged
                gs = spikes.GuardState(data_step + 1 - step,
                                       gs.lr_factor * cfg.rollback_lr_factor, saved.rejected,
                                       gs.events, gs.rollbacks + 1)
                gs.events.append({"step": record["step"], "event": "rollback", "to": step,
                                  "skipped_batches": skipped, "lr_factor": gs.lr_factor})
                write(gs.events[-1])
                note(f"rolled back to step {step}; batches {skipped[0]}..{skipped[1]} skipped, "
                     f"learning rate now x{gs.lr_factor:g}", "note")
                window = spikes.Window.rebuild(cfg.spike_window, cfg.spike_z, losses, norms,
                                               set(gs.rejected))
                if gs.rollbacks >= spikes.MAX_ROLLBACKS:
                    note(f"{gs.rollbacks} rollbacks: stopping here; look at the run")
                    break
                continue
            too_many = in_a_row >= cfg.spike_window
            if too_many:
                note(f"the guard rejected {in_a_row} steps in a row: stopping (the run has "
                     "diverged, or --spike-z is too tight)")
            # process 0's decision, so that every process stops at this step
            stop = distributed.agree(reached_at is not None or nonfinite_at is not None
                                     or action == "stop" or too_many)
            halted = not stop and halt_after is not None and step >= halt_after
            if (ckpt is not None and nonfinite_at is None
                    and ckpt.due(step, last=stop or halted or step == cfg.steps)):
                if jsonl is not None:
                    jsonl.flush()  # a resumed run finds every line up to its checkpoint
                ckpt.save(step, step_fn.canonical.to_canonical(state), run_meta(
                    cfg, plan, batches.position(step + gs.data_offset), losses, norms,
                    val_curve, tokens, guard=gs.to_json()))
            if stop or halted:
                break
    except KeyboardInterrupt:  # Ctrl-C: keep what ran, write it below, then stop the caller
        interrupted = True
    finally:
        bar.close()
        if prof.running:
            prof.stop()
        if jsonl is not None:
            jsonl.close()
        if ckpt is not None:
            ckpt.close()  # an asynchronous save in flight is finished, not dropped
    train_s = time.perf_counter() - t_start
    # a final validation, unless the parameters are NaN or the user asked to stop now
    if (not interrupted and not halted and nonfinite_at is None
            and (not val_curve or val_curve[-1][0] != len(losses))):
        val_curve.append((len(losses), evaluate(eval_fn, whole(state), val_batches)))
    result = TrainResult(
        config=asdict(cfg), param_count=model_config.param_count(mcfg), entropy_floor=floor,
        loss_curve=losses, grad_norms=norms, val_curve=val_curve,
        val_loss=val_curve[-1][1] if val_curve else math.nan,
        steps_run=len(losses), tokens_seen=tokens, compile_s=compile_s, train_s=train_s,
        tokens_per_s=(tokens - tokens_before) / max(train_s - compile_s, 1e-9),
        loss_scale=float(state.loss_scale), skipped_steps=int(state.skipped),
        reached_gap_at_s=reached_at, nonfinite_step=nonfinite_at, interrupted=interrupted,
        halted=halted, resumed_from=start or None, spike_events=gs.events,
        rollbacks=gs.rollbacks, steps_computed=steps_run)
    if out is not None:
        if not interrupted and any(map(math.isfinite, losses)):
            plot_loss_curve(result, out / "loss_curve.png")
        (out / "result.json").write_text(json.dumps(result.to_json(), indent=1))
    if interrupted:
        raise TrainInterrupted(result)
    return result


def _resumed_metrics(meta: dict):
    """(losses, norms, val_curve, tokens, guard state) as a checkpoint's JSON holds them."""
    done = meta["metrics"]
    return (list(done["loss_curve"]), list(done["grad_norms"]),
            [tuple(v) for v in done["val_curve"]], done["tokens_seen"],
            spikes.GuardState.from_json(meta.get("guard")))


def _reject(cfg, ckpt, step, loss, gnorm, guard, note):
    """(action, event) for a step the guard rejected: what it was and what happens now."""
    finite = math.isfinite(loss) and math.isfinite(gnorm)
    action = cfg.spike_policy if finite and cfg.spike_policy != "none" else "skip"
    if action == "rollback" and not ckpt.saved_any():
        action = "skip"  # nothing to roll back to yet
    event = {"step": step, "event": "spike" if finite else "nonfinite", "action": action,
             "loss": loss, "grad_norm": gnorm, "loss_max": float(guard.loss_max),
             "norm_max": float(guard.norm_max)}
    which = ("loss" if not loss <= guard.loss_max else "gradient norm") if finite else ""
    note(f"step {step}: " + (f"spike ({which} {loss if which == 'loss' else gnorm:.4g} > "
                             f"{guard.loss_max if which == 'loss' else guard.norm_max:.4g})"
                             if finite else f"non-finite loss {loss} / gradient norm {gnorm}")
         + f": {action}")
    return action, event


def _open_metrics(path: Path, start: int):
    """metrics.jsonl for writing; resuming at `start`, the lines of steps 1..start that a
    run wrote here before are kept (a later step's line, from a run that went on past its
    last checkpoint, is dropped: those steps run again)."""
    kept = []
    if start and path.exists():
        for line in path.read_text().splitlines():
            try:  # the last line of a killed run may be half written
                if json.loads(line).get("step", 0) <= start:
                    kept.append(line)
            except ValueError:
                continue
    f = open(path, "w")
    f.writelines(line + "\n" for line in kept)
    return f

