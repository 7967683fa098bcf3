"""`jaxscale train`: train a model on the garden corpus and report it next to the floor.

Parse (the options: jaxscale.cli.train_options) -> run -> print."""
from __future__ import annotations

import json
import math
import os
import sys

from jaxscale.cli.commands import train_notes
from jaxscale.cli.main import EXIT_FAILED, EXIT_INTERRUPTED, _error
from jaxscale.runtime.compile_cache import enable_compilation_cache
from jaxscale.runtime.processes import SUPERVISED_ENV
from jaxscale.runtime import mesh as meshlib


def register(subparsers) -> None:
    from jaxscale.cli import train_options

    from jaxscale.cli import config_file
    p = train_options.add_parser(subparsers)
    config_file.add_argument(p)
    p.set_defaults(run=run, parser=p)


def _checkpoint_options(args):
    """The checkpoint options, validated before anything is written (CheckpointError)."""
    from jaxscale.training.checkpoint.manager import CheckpointOptions
    from jaxscale.training.checkpoint.store import CheckpointError

    given = [flag for flag, on in (
        ("--checkpoint-every", args.checkpoint_every is not None), ("--resume", args.resume),
        ("--async-checkpoint", args.async_checkpoint), ("--keep", args.keep is not None),
        ("--accept-lr-change", args.accept_lr_change),
        ("--halt-after", args.halt_after is not None)) if on]
    if args.checkpoint_dir is None:
        if given:
            raise CheckpointError(f"{', '.join(given)} need{'s' if len(given) == 1 else ''} "
                                  "--checkpoint-dir DIR")
        return None
    if args.checkpoint_every is None and not args.resume:
        raise CheckpointError("--checkpoint-dir needs --checkpoint-every N (to save) or "
                              "--resume (to continue), or both")
    unused = [flag for flag in given if flag in ("--async-checkpoint", "--keep", "--halt-after")]
    if args.checkpoint_every is None and unused:
        raise CheckpointError(f"{', '.join(unused)} only apply when saving; add "
                              "--checkpoint-every N")
    if args.accept_lr_change and not args.resume:
        raise CheckpointError("--accept-lr-change only applies with --resume")
    keep = CheckpointOptions.keep if args.keep is None else args.keep
    options = CheckpointOptions(str(args.checkpoint_dir), every=args.checkpoint_every,
                                keep=keep, async_save=args.async_checkpoint,
                                resume=args.resume, accept_lr_change=args.accept_lr_change)
    options.validate()
    return options


def _setup_devices(args):
    """Force CPU devices (this process's share of them, when it is one of several) and
    validate the mesh, before any JAX computation."""
    from jaxscale.runtime import devices, processes as distributed

    cluster = distributed.from_args(args)
    shape = meshlib.parse_mesh_spec(args.mesh) if args.mesh is not None else None
    if shape is not None and args.devices is not None and shape.size != args.devices:
        raise meshlib.MeshSpecError(f"mesh {args.mesh} has {shape.size} devices but --devices "
                                    f"is {args.devices}; make them equal")
    if cluster is not None:
        distributed.start(cluster, args.devices)
        found = None
    else:  # forced CPU devices, or the platform's own
        found = devices.pick_devices(args.platform, args.devices)
    if shape is None:
        return None
    if found is not None and found[0].platform != "cpu":
        if shape.size > len(found):
            raise devices.DeviceError(f"mesh {args.mesh} needs {shape.size} devices; there "
                                      f"{'is' if len(found) == 1 else 'are'} {len(found)} "
                                      f"{found[0].platform} device(s) here")
        return meshlib.make_mesh(shape, found[:shape.size])
    return meshlib.make_mesh(shape)  # sizes must match the (global) devices


def _config(args):
    """The TrainConfig the options describe (not yet validated)."""
    from jaxscale.parallel.schedules import VEE
    from jaxscale.training.config import TrainConfig

    several = args.num_processes is not None and args.num_processes > 1
    if args.mesh is None and several and args.devices is not None:
        args.mesh = f"dp={args.devices}"  # several processes: the mesh spans all devices
    cfg = TrainConfig(model=args.model, steps=args.steps, optimizer=args.optimizer, lr=args.lr,
                      lr_schedule=args.lr_schedule, warmup=args.warmup,
                      batch_size=args.batch_size, seed=args.seed, eval_every=args.eval_every,
                      n_train_docs=args.train_docs,
                      stop_gap=args.stop_gap, precision=args.precision,
                      optimizer_state_dtype=args.optimizer_state_dtype,
                      fp8_block=args.fp8_block, fp8_head=args.fp8_head,
                      fp8_history=args.fp8_history,
                      mesh=args.mesh or "dp=1", micro_batches=args.micro_batches or 1,
                      remat=args.remat, zero_stage=args.zero, schedule=args.schedule,
                      sequence_parallel=args.sequence_parallel,
                      virtual=args.virtual or (2 if args.schedule in ("interleaved", *VEE) else 1),
                      spike_policy=args.spike_policy, spike_z=args.spike_z,
                      spike_window=args.spike_window,
                      rollback_lr_factor=args.rollback_lr_factor)
    return cfg


def run(args) -> int:
    import dataclasses

    import jax

    from jaxscale.training.checkpoint.manager import CheckpointWriteError
    from jaxscale.cli.runtime_options import resolve_attention
    from jaxscale.runtime.processes import is_main
    from jaxscale.report import plural
    from jaxscale.training.faults import parse_faults
    from jaxscale.training.config import TrainConfig, TrainConfigError
    from jaxscale.training.result import TrainInterrupted
    from jaxscale.training.loop import train

    cfg = _config(args)
    if args.tensorboard is not None:  # the writer is installed, before JAX starts
        from jaxscale.training.tensorboard import writer_class
        writer_class()
    if args.halt_after is not None and args.halt_after >= cfg.steps:
        raise TrainConfigError(f"--halt-after {args.halt_after} must be below --steps "
                               f"{cfg.steps}; it stops the run early")
    checkpoint = _checkpoint_options(args)
    if checkpoint is not None and checkpoint.resume and args.micro_batches is None:
        cfg = _elastic(cfg, checkpoint.directory)
    cfg.validate()
    faults = parse_faults(args.inject, cfg.steps)
    if args.max_restarts is not None and not os.environ.get(SUPERVISED_ENV):
        return _supervise(args, checkpoint)
    if checkpoint is not None and checkpoint.resume:
        from jaxscale.training.checkpoint.manager import check_resumable
        check_resumable(checkpoint.directory, dataclasses.asdict(cfg),
                        checkpoint.accept_lr_change)
    _setup_devices(args)
    if args.mesh is None and jax.process_count() > 1:  # a cluster's own devices: dp over all
        cfg = dataclasses.replace(cfg, mesh=f"dp={jax.device_count()}")
    cfg = dataclasses.replace(cfg, attention=resolve_attention(
        args.attention, jax.default_backend(), cfg.precision), unroll=args.unroll)
    cfg.validate()
    cfg.check_platform(jax.default_backend())
    enable_compilation_cache()

    def log(msg, kind="warning"):
        print(f"jaxscale: {kind}: {msg}", file=sys.stderr)

    train_notes.before_run(args, cfg, log)

    main = is_main()  # several processes: only process 0 prints
    try:
        result = train(cfg, out_dir=args.out, progress=not args.json, log=log,
                       checkpoint=checkpoint, halt_after=args.halt_after, faults=faults,
                       profile=args.profile, tensorboard=args.tensorboard)
    except CheckpointWriteError as e:
        _error(str(e))
        return EXIT_FAILED
    except TrainInterrupted as e:
        if not main:
            return EXIT_INTERRUPTED
        _write_config(args)
        if args.json:  # the steps that ran, as compare --json prints its partial table
            print(json.dumps(e.result.to_json()))
        print(f"jaxscale: interrupted after {plural(e.result.steps_run, 'step')} of "
              f"{cfg.steps:,}; metrics so far and a partial result.json "
              f"(\"interrupted\": true) in {args.out}/", file=sys.stderr)
        if checkpoint is not None:
            print(train_notes.resume_hint(args.argv, checkpoint.directory), file=sys.stderr)
        return EXIT_INTERRUPTED
    if not main:
        return EXIT_FAILED if result.nonfinite_step is not None else 0
    _write_config(args)
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        _print_summary(result, args.out)
    if result.nonfinite_step is not None:
        _error(_diverged_message(result, cfg))
        return EXIT_FAILED
    return 0


def _write_config(args) -> None:
    """The run's config.toml; a checkpoint folder only resumed from (no --checkpoint-every)
    served this run alone, like --resume: the file repeats the run from its first step."""
    from jaxscale.cli import config_file
    config_file.write(args.parser, args, args.out,
                      one_off=("checkpoint-dir",) if args.checkpoint_every is None else ())


def _elastic(cfg, directory):
    """Resuming on another mesh without --micro-batches: the global batch is kept and the
    micro-batches raised so that no micro-batch has more rows than the checkpoint's
    (plan.elastic_micro_batches); PlanError when the new dp cannot split the batch."""
    import dataclasses

    from jaxscale.training.checkpoint.store import CheckpointDamaged, complete_steps, read_meta
    from jaxscale.parallel.plan import Plan, elastic_micro_batches

    try:
        saved = Plan(**read_meta(directory, complete_steps(directory)[-1])["plan"])
    except (CheckpointDamaged, KeyError, TypeError):
        return cfg  # the restore names what is wrong with it
    m = elastic_micro_batches(saved, cfg.plan(validate=False), cfg.batch_size)
    if m != cfg.micro_batches:
        print(f"jaxscale: note: {m} micro-batches per step keep the global batch of "
              f"{cfg.batch_size} at {cfg.batch_size // (saved.rows * saved.micro_batches)} rows "
              f"per micro-batch or fewer, as the checkpoint's plan {saved.layout()}",
              file=sys.stderr)
        cfg = dataclasses.replace(cfg, micro_batches=m)
    return cfg


def _supervise(args, checkpoint) -> int:
    """`--max-restarts R`: this process supervises; a child process trains (supervise.py)."""
    from jaxscale.training.checkpoint.store import CheckpointError
    from jaxscale.report import plural
    from jaxscale.training.supervise import describe, supervise

    if checkpoint is None or checkpoint.every is None:
        raise CheckpointError("--max-restarts restarts from the latest checkpoint: give "
                              "--checkpoint-dir DIR and --checkpoint-every N")
    if args.num_processes is not None or args.coordinator is not None:
        raise CheckpointError("--max-restarts supervises one process; it cannot be combined "
                              "with --num-processes or --coordinator")
    done = supervise(args.argv, checkpoint.directory, args.max_restarts, args.resume,
                     as_json=args.json)
    if done.restarts and not args.json:
        print(f"jaxscale: {plural(done.restarts, 'restart')} (" + ", ".join(
            describe(a.returncode) for a in done.attempts[:-1]) + ")", file=sys.stderr)
    return done.returncode


def _diverged_message(r, cfg) -> str:
    """Where the loss stopped being a number, and what usually keeps it one."""
    tips = [f"a lower --lr (now {cfg.lr:g}, e.g. {cfg.lr / 10:g})",
            f"a longer --warmup (now {cfg.warmup})"]
    if cfg.precision != "fp32":  # low precision overflows first: fp32, or fp16's loss scaling
        tips.append("--precision fp32" if cfg.precision == "fp16"
                    else "--precision fp32, or fp16 (dynamic loss scaling)")
    return (f"the training loss became {r.loss_curve[-1]} at step {r.nonfinite_step:,}, so "
            f"training stopped there; try {', or '.join(tips)}")


def _print_summary(r, out) -> None:
    from rich.console import Console
    from rich.table import Table

    from jaxscale.report import plural

    table = Table(title=f"jaxscale train: {r.config['model']}", show_header=False)
    rows = [
        ("parameters", f"{r.param_count:,}"),
        ("precision", f"{r.config['precision']} (loss scale at the end {r.loss_scale:g}, "
                      f"{plural(r.skipped_steps, 'skipped step')})"),
        ("steps", f"{r.steps_run:,} ({plural(r.tokens_seen, 'target token')})"),
        ("final training loss", f"{r.loss_curve[-1]:.4f} nats/token"),
        ("validation loss", f"{r.val_loss:.4f} nats/token" if math.isfinite(r.val_loss)
         else f"not measured ({train_notes.no_validation(r)})"),
        ("entropy floor (exact)", f"{r.entropy_floor:.4f} nats/token"),
        ("gap to floor", f"{r.gap:.4f} nats" if math.isfinite(r.gap) else "-"),
        ("compile (first step)", f"{r.compile_s:.2f} s"),
        ("training wall time", f"{r.train_s:.1f} s, {r.tokens_per_s:,.0f} tokens/s"),
    ]
    if r.reached_gap_at_s is not None:
        rows.append((f"reached gap <= {r.config['stop_gap']}", f"after {r.reached_gap_at_s:.1f} s"))
    if r.resumed_from is not None:
        rows.append(("resumed", f"from the checkpoint of step {r.resumed_from:,}"))
    if r.halted:
        rows.append(("halted", f"after step {r.steps_run:,} of {r.config['steps']:,} "
                               "(--halt-after); continue with --resume"))
    guard = [e for e in r.spike_events if e["event"] in ("spike", "nonfinite")]
    if r.config["spike_policy"] != "none" or r.spike_events:
        kinds = {k: sum(e["event"] == k for e in guard) for k in ("spike", "nonfinite")}
        rows.append(("spike guard", f"{r.config['spike_policy']}: "
                     f"{plural(kinds['spike'], 'spike')}, "
                     f"{plural(kinds['nonfinite'], 'non-finite step')}, "
                     f"{plural(r.rollbacks, 'rollback')} "
                     f"({plural(r.steps_computed, 'step')} computed)"))
    for k, v in rows:
        table.add_row(k, v)
    Console().print(table)
    print(f"metrics, loss curve and result in {out}/")
