"""Training metrics as TensorBoard scalars: `jaxscale train --tensorboard DIR`.

metrics.jsonl stays the run's record; this hook writes the same figures where many users
already compare runs. The writer is tensorboardX's (an optional extra: pip install -e
".[tensorboard]"), which needs neither TensorFlow nor PyTorch. Scalars, by step:

    train/loss             nats per token, this step's batch
    train/grad_norm        the global L2 norm of the gradient (before clipping)
    train/learning_rate    the rate the update used (the schedule x the guard's factor)
    train/loss_scale       the fp16 loss scale (1 without scaling)
    train/tokens_per_s     target tokens per second since the first step compiled
    eval/val_loss          nats per token on the validation batches, when validated
    eval/gap_to_floor      val_loss minus the corpus's exact entropy floor, nats
    guard/rejected         1 at each step the spike guard rejected
    guard/lr_factor        the guard's learning-rate factor (rollbacks lower it)

A non-finite loss or norm is not written (TensorBoard's charts cannot draw it);
metrics.jsonl has it, and guard/rejected marks the step when the guard caught it.
"""
from __future__ import annotations

import math

from jaxscale.training.config import TrainConfigError
from jaxscale.training.hooks import Hook

SCALARS = {"loss": "train/loss", "grad_norm": "train/grad_norm", "lr": "train/learning_rate",
           "loss_scale": "train/loss_scale", "val_loss": "eval/val_loss",
           "gap": "eval/gap_to_floor"}


def writer_class():
    """tensorboardX's SummaryWriter, or TrainConfigError with the install command."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise TrainConfigError("--tensorboard needs tensorboardX, an optional extra: "
                               "pip install -e \".[tensorboard]\"") from None
    return SummaryWriter


class TensorBoard(Hook):
    """Writes each step's scalars (module docstring) to an event file in `logdir`."""

    def __init__(self, logdir):
        self.logdir, self.writer = logdir, None
        self.kind = writer_class()  # checked before the first step, not at its end

    def begin(self, run):
        self.writer = self.kind(logdir=str(self.logdir))

    def on_step(self, run):
        step = run.step
        for key, tag in SCALARS.items():  # a NaN or inf is left out: guard/rejected says
            if key in run.record and math.isfinite(run.record[key]):
                self.writer.add_scalar(tag, float(run.record[key]), step)
        elapsed = run.clock() - run.t_start - run.compile_s
        if run.steps_run > 1 and elapsed > 0:
            self.writer.add_scalar("train/tokens_per_s",
                                   (run.tokens - run.tokens_before) / elapsed, step)
        if not run.accepted:
            self.writer.add_scalar("guard/rejected", 1.0, step)
        self.writer.add_scalar("guard/lr_factor", run.gs.lr_factor, step)

    def close(self):
        if self.writer is not None:
            self.writer.close()
