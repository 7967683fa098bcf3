"""Everything a training run needs before its first step: the config checked, the corpus,
the step of its Plan, the state (fresh or resumed from a checkpoint), and the hooks."""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import jax

from jaxscale import garden
from jaxscale.data.sampler import StepBatches
from jaxscale.model import config as model_config
from jaxscale.parallel.build import build_train_step
from jaxscale.report import Progress
from jaxscale.runtime import processes, profiling
from jaxscale.files import start_output_set
from jaxscale.training import hooks as H
from jaxscale.training.tensorboard import TensorBoard
from jaxscale.training.checkpoint.manager import Checkpointer
from jaxscale.training.config import TrainConfig, TrainConfigError, lr_schedule
from jaxscale.training.faults import FAULTS_FILE, FaultLog
from jaxscale.training.reference import init_run, make_eval_step
from jaxscale.training.run import Run, open_metrics, resumed_metrics

RUN_FILES = ("result.json", "loss_curve.png", "config.toml")  # written at the end
# (metrics.jsonl: open_metrics; config.toml: the command, once the run has run)


def check_config(cfg: TrainConfig, checkpoint) -> None:
    """Refuse, before anything is built, a config this machine or these options cannot run."""
    cfg.validate()
    cfg.check_platform(jax.default_backend())
    if cfg.spike_policy == "rollback" and (checkpoint is None or checkpoint.every is None):
        raise TrainConfigError("spike policy rollback restores the last checkpoint: give a "
                               "checkpoint directory and a save interval (--checkpoint-dir, "
                               "--checkpoint-every), or use --spike-policy skip")


def load_corpus(cfg: TrainConfig, corpus: garden.Corpus | None) -> garden.Corpus:
    """The config's corpus, or the one given, checked against the model and the batch."""
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
    return corpus


def start_run(cfg, corpus, out_dir, progress, log, checkpoint, halt_after, faults, profile,
              tensorboard=None):
    """(run, hooks, validator, output folder or None, profiler): ready for the first step."""
    mcfg, plan = model_config.preset(cfg.model), cfg.plan()
    graphdef, params, optimizer = init_run(cfg)
    init_fn, step_fn = build_train_step(mcfg, plan, optimizer)
    main = processes.is_main()  # one voice: only process 0 prints and writes
    log = log if main else None
    run = Run(cfg, plan, mcfg, step_fn,
              StepBatches(corpus.train, cfg.batch_size, mcfg.seq_len, cfg.seed),
              corpus.entropy_floor, log or (lambda msg, kind="warning": None),
              schedule=lr_schedule(cfg))
    ckpt = None if checkpoint is None else Checkpointer(checkpoint, log)

    def restore():
        """The latest checkpoint's step, state (resharded into this plan) and meta."""
        step, canonical, meta = ckpt.restore(step_fn.canonical, asdict(cfg))
        return step, step_fn.canonical.from_canonical(canonical), meta

    try:  # the checkpointer's threads and metrics.jsonl are released if setup fails
        out = _resume_or_init(run, ckpt, checkpoint, restore, init_fn, params, halt_after,
                              out_dir if main else None)
        validator = H.Validator(make_eval_step(graphdef), step_fn.full_params,
                                corpus.val_batches(cfg.batch_size * 4))
        profiler = profiling.Profiler(profile if main else None)
        fault_log = FaultLog(faults, None if checkpoint is None else
                             Path(checkpoint.directory) / FAULTS_FILE, write=main,
                             resumed_from=run.start)
        # the guarded step when it has something to do; else the plain one, not a bit apart
        guarded = cfg.spike_policy != "none" or any(f.kind in ("nan", "lr") for f in faults)
        scalars = [TensorBoard(tensorboard)] if tensorboard is not None and main else []
        hooks = [H.FaultInjector(fault_log), H.Profiler(profiler),
                 H.SpikeGuard(guarded, ckpt, restore), validator, H.MetricsWriter(run.metrics),
                 *scalars,
                 H.ProgressBar(Progress(cfg.steps, progress and main, label="train")),
                 H.StopVote(halt_after), H.CheckpointSaver(ckpt)]
        for hook in hooks:
            hook.begin(run)
    except BaseException:
        if ckpt is not None:
            ckpt.close()
        if run.metrics is not None:
            run.metrics.close()
        raise
    run.t_start = run.clock()
    return run, hooks, validator, out, profiler


def _resume_or_init(run, ckpt, checkpoint, restore, init_fn, params, halt_after, out_dir):
    """The state (from the latest checkpoint with resume, else fresh), the step range, and
    the output folder with metrics.jsonl opened (None off process 0 or without out_dir)."""
    cfg = run.cfg
    if ckpt is not None and checkpoint.resume:
        run.start, run.state, meta = restore()
        run.losses, run.norms, run.val_curve, run.tokens, run.gs = resumed_metrics(meta)
        run.note(f"resumed from {ckpt.directory / str(run.start)} (saved under "
                 f"{meta['plan_layout']} on {meta['processes']} process(es)), now under "
                 f"{run.plan.layout()}", "note")
    else:
        run.state = init_fn(params)
    if halt_after is not None and not run.start < halt_after:
        raise TrainConfigError(f"halt_after={halt_after} must come after the step this "
                               f"run starts from ({run.start})")
    out = Path(out_dir) if out_dir is not None else None
    if out is not None:
        start_output_set(out, RUN_FILES)  # no earlier run's result beside this one's
        run.metrics = open_metrics(out / "metrics.jsonl", run.start)
    # a run that had already reached its stop gap when it was saved does not train on
    reached_before = (cfg.stop_gap is not None and bool(run.val_curve)
                      and run.val_curve[-1][1] - run.floor <= cfg.stop_gap)
    run.step, run.tokens_before = run.start, run.tokens
    run.end = run.start if reached_before else cfg.steps
    return out
