"""What `jaxscale train` says besides its result: notes on what the command line left
unsaid (devices left idle, a warm-up shortened to half the run), why a run has no
validation loss, and after a Ctrl-C the command that resumes from the last complete
checkpoint."""
from __future__ import annotations

import os


def before_run(args, cfg, log) -> None:
    """What the run does that the command line did not say: devices left idle, a warm-up
    shortened to half the run (process 0 says it)."""
    import jax

    from jaxscale.model import config as model_config
    from jaxscale.parallel.fits import kv_heads_note
    from jaxscale.report import plural
    from jaxscale.runtime.processes import is_main
    from jaxscale.training.config import TrainConfig, warmup_steps

    if not is_main():
        return
    idle = jax.device_count() - cfg.plan(validate=False).n_devices
    if args.devices is not None and args.mesh is None and idle > 0:
        log(f"--devices {args.devices} without --mesh: the mesh is {cfg.mesh}, so "
            f"{plural(idle, 'device')} {'stays' if idle == 1 else 'stay'} idle; spread the "
            f"run with --mesh dp={jax.device_count()} (or any mesh of {jax.device_count()})",
            "note")
    note = kv_heads_note(model_config.preset(cfg.model), cfg.plan(validate=False))
    if note:
        log(note, "note")
    if warmup_steps(cfg) < cfg.warmup != TrainConfig.warmup:  # a warm-up the user asked for
        log(f"--warmup {cfg.warmup:,} is more than half of --steps {cfg.steps:,}: the "
            f"learning rate warms up over {warmup_steps(cfg):,} steps (result.json: "
            "warmup_steps)", "note")


def resume_hint(argv: list[str], directory: str) -> str:
    """The line that says where the run can go on from, and the exact command that does."""
    import shlex

    from jaxscale.training.checkpoint.store import complete_steps

    steps = complete_steps(directory)
    if not steps:
        return f"jaxscale: no complete checkpoint in {directory} yet; the run starts over"
    done = f"jaxscale: the checkpoint of step {steps[-1]:,} is complete"
    if os.environ.get("JAXSCALE_LAUNCHED"):  # argv is one process's, placed by the launcher
        return (f"{done}; resume with the same `jaxscale launch ...` command, --resume "
                "added to train's options")
    again = argv if "--resume" in argv else [*argv, "--resume"]
    return f"{done}; resume with: {shlex.join(['jaxscale', *again])}"


def no_validation(r) -> str:
    """Why a run (a TrainResult) has no validation loss: it diverged, or it stopped before
    its first evaluation."""
    if r.nonfinite_step is not None or r.val_curve:  # the last evaluation gave NaN
        return "the loss diverged"
    if r.halted:
        return f"halted (--halt-after) after {r.steps_run:,} steps, before the first evaluation"
    if r.interrupted:
        return f"interrupted after {r.steps_run:,} steps, before the first evaluation"
    return "no evaluation ran"
