"""The training loop: run the step, then the hooks.

`train(cfg)` builds the step of the config's Plan (`parallel.build`), sets up a `Run` and
its hooks (`training.hooks`: faults, profiler, spike guard, validation, metrics, progress,
the stop vote, checkpoints), and then, step after step: the hooks' `before_step`, one
compiled step on this step's batch, the hooks' `on_step` and `after_step`. Everything a
run writes (metrics.jsonl, loss_curve.png, result.json) comes from the hooks and `finish`.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from pathlib import Path

import jax

from jaxscale import garden
from jaxscale.model import config as model_config
from jaxscale.model.precision import policy
from jaxscale.report import plot_loss_curve
from jaxscale.files import write_text_atomically
from jaxscale.training import hooks as H
from jaxscale.training.config import TrainConfig, warmup_steps
from jaxscale.training.faults import bad_batch, poison
from jaxscale.training.result import TrainInterrupted, TrainResult
from jaxscale.training.run import Run
from jaxscale.training.setup import check_config, load_corpus, start_run


def train(cfg: TrainConfig, out_dir: str | Path | None = None, progress: bool = True,
          log=None, checkpoint=None, halt_after: int | None = None, faults=(),
          corpus: garden.Corpus | None = None, profile: str | Path | None = None,
          tensorboard: str | Path | None = None) -> TrainResult:
    """Train on the garden corpus; write metrics.jsonl, loss_curve.png, result.json into out_dir.

    `corpus` replaces the one cfg describes (make_corpus(cfg.seed, cfg.n_train_docs, ...)):
    the data experiment trains on a duplicated and a deduplicated set this way. Its
    seq_len must be the model's; a checkpoint records the data position, not the corpus.
    `tensorboard`: a folder for TensorBoard scalars of every step (training.tensorboard;
    process 0 only). `profile`: a jax.profiler trace of PROFILE_STEPS steps after the first
    (which compiles) goes to that folder (jaxscale.runtime.profiling; process 0 only).

    `checkpoint` (CheckpointOptions) saves the state every so many steps (and at the last)
    and, with resume, continues from the latest complete checkpoint under this config's
    plan, whichever plan wrote it (jaxscale.training.checkpoint.manager); `halt_after` stops
    after that step as if interrupted, keeping the schedule of all cfg.steps, so that a
    later run can resume it.

    cfg.spike_policy guards every step against loss spikes (jaxscale.training.spikes);
    `faults` (training.faults.Fault) provoke them, and crashes, on purpose. Every guard
    event is a line of metrics.jsonl and an entry of result.spike_events.

    Under several processes (jax.distributed) every process runs this loop over one global
    mesh, each building only its own rows of every batch (data.sampler); only process 0
    shows progress and writes, and the stop decisions are process 0's, broadcast.
    Without a guard, a NaN or inf loss stops training at that step (result.nonfinite_step
    says which); with one, that step is skipped. Ctrl-C stops training too: metrics.jsonl
    and a result.json with "interrupted": true are written, then TrainInterrupted (a
    KeyboardInterrupt) is raised with the partial result.
    """
    check_config(cfg, checkpoint)
    run, hooks, validator, out, profiler = start_run(
        cfg, load_corpus(cfg, corpus), out_dir, progress, log, checkpoint, halt_after,
        faults, profile, tensorboard)
    try:
        while run.step < run.end:
            run.begin_step()
            _step(run, hooks, profiler)
            if run.abort:
                break
            if run.rolled_back:
                continue
            if run.stop or run.halted:
                break
    except KeyboardInterrupt:  # Ctrl-C: keep what ran, write it below, then stop the caller
        run.interrupted = True
    finally:
        H.close_all(hooks)
    return finish(run, validator, out)


def _step(run: Run, hooks: list[H.Hook], profiler) -> None:
    """One step: the hooks before it, the compiled step on this step's batch, the hooks after."""
    cfg, mcfg = run.cfg, run.mcfg
    for hook in hooks:
        hook.before_step(run)
    spike = next((f for f in run.due if f.kind == "spike"), None)
    if spike is None:  # this process's rows of the global batch
        batch = run.batches.place(run.data_step, run.step_fn.batch_sharding)
        n_tokens = run.batches.n_tokens(run.data_step)
    else:
        batch = bad_batch(spike.arg, cfg.batch_size, mcfg.seq_len, mcfg.vocab_size, cfg.seed,
                          run.step, run.step_fn.batch_sharding)
        n_tokens = cfg.batch_size * mcfg.seq_len
    if any(f.kind == "nan" for f in run.due):
        batch = poison(batch)
    t0 = run.clock()
    with profiler.step(run.step):
        run.state, m = run.step_fn(run.state, batch, run.guard)
        m = jax.device_get(m)  # waits for the step; one transfer for all metrics
    run.loss, run.gnorm, run.accepted = float(m["loss"]), float(m["grad_norm"]), bool(m["accepted"])
    skipped = int(m["skipped"])  # updates skipped so far, this step's included
    applied = run.accepted and (bool(m["finite"]) or policy(cfg.precision).loss_scale != "dynamic")
    count = run.step - 1 - (skipped - (not applied))  # the optimizer's: skips do not advance it
    if run.steps_run == 0:
        run.compile_s = run.clock() - t0
    run.steps_run += 1
    run.losses.append(run.loss)
    run.norms.append(run.gnorm)
    run.tokens += n_tokens
    run.record = {"step": run.step, "batch": run.data_step, "wall": time.time(),
                  "loss": run.loss, "grad_norm": run.gnorm, "n_tokens": n_tokens,
                  "lr": float(run.schedule(count)) * run.gs.lr_factor,  # this step's update's
                  "loss_scale": float(m["loss_scale"]), "skipped": skipped,
                  "time_s": run.clock() - run.t_start}
    for hook in hooks:
        hook.on_step(run)
    for hook in hooks:
        hook.after_step(run)
        if run.rolled_back:
            break


def finish(run: Run, validator: H.Validator, out: Path | None) -> TrainResult:
    """The final validation (unless the parameters are NaN or the user asked to stop now),
    the result, and the files: result.json and loss_curve.png."""
    train_s = run.clock() - run.t_start
    if (not run.interrupted and not run.halted and run.nonfinite_at is None
            and (not run.val_curve or run.val_curve[-1][0] != len(run.losses))):
        run.val_curve.append((len(run.losses), validator.loss(run)))
    result = TrainResult(
        config=asdict(run.cfg), param_count=model_config.param_count(run.mcfg),
        entropy_floor=run.floor, loss_curve=run.losses, grad_norms=run.norms,
        val_curve=run.val_curve, val_loss=run.val_curve[-1][1] if run.val_curve else math.nan,
        steps_run=len(run.losses), tokens_seen=run.tokens, compile_s=run.compile_s,
        train_s=train_s,
        tokens_per_s=(run.tokens - run.tokens_before) / max(train_s - run.compile_s, 1e-9),
        loss_scale=float(run.state.loss_scale), skipped_steps=int(run.state.skipped),
        reached_gap_at_s=run.reached_at, nonfinite_step=run.nonfinite_at,
        interrupted=run.interrupted, halted=run.halted, resumed_from=run.start or None,
        spike_events=run.gs.events, rollbacks=run.gs.rollbacks, steps_computed=run.steps_run,
        warmup_steps=warmup_steps(run.cfg))
    if out is not None:
        if not run.interrupted and any(map(math.isfinite, run.losses)):
            plot_loss_curve(result, out / "loss_curve.png")
        write_text_atomically(out / "result.json", json.dumps(result.to_json(), indent=1))
    if run.interrupted:
        raise TrainInterrupted(result)
    return result
