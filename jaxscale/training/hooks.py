"""The loop's hooks: each owns one concern and decides its own frequency.

The loop calls, in the order of its list, `before_step` (faults fire, the guard sets its
limits), runs the step, then `on_step` (what the step means: accepted or rejected,
validated, written, shown) and `after_step` (what happens next: a rollback, the stop vote,
a checkpoint). `begin` runs once before the first step, `close` once at the end, also
after an error or Ctrl-C.
"""
from __future__ import annotations

import math

import numpy as np

from jaxscale.parallel.step import Guard
from jaxscale.runtime import processes
from jaxscale.training import faults as faultlib, spikes
from jaxscale.training.checkpoint.meta import run_meta
from jaxscale.training.reference import evaluate
from jaxscale.training.run import Run, resumed_metrics

PROFILE_STEPS = 10  # steps a --profile trace holds (more make files of many megabytes)


class Hook:
    """A concern of the training loop; every method does nothing unless overridden."""

    def begin(self, run: Run) -> None:
        pass

    def before_step(self, run: Run) -> None:
        pass

    def on_step(self, run: Run) -> None:
        pass

    def after_step(self, run: Run) -> None:
        pass

    def close(self) -> None:
        pass


def close_all(hooks) -> None:
    """Close every hook in order, each even when one before it raised (a trace that cannot
    be written must not leave an async checkpoint unwaited), then raise the first error."""
    first = None
    for hook in hooks:
        try:
            hook.close()
        except BaseException as e:  # a Ctrl-C too: the rest still close
            first = first or e
    if first is not None:
        raise first


class FaultInjector(Hook):
    """Fires the faults due at this step (each once per run, `training.faults`)."""

    def __init__(self, log: faultlib.FaultLog):
        self.log = log

    def before_step(self, run):
        run.due = self.log.due(run.step)
        for f in run.due:
            run.gs.events.append({"step": run.step, "event": "inject", "fault": str(f)})
            run.write(run.gs.events[-1])
            run.note(f"step {run.step}: injecting fault {f}", "note")
            if f.kind == "crash":
                faultlib.crash()
            if f.kind == "lr":
                run.gs.lr_factor *= float(f.arg)


class Profiler(Hook):
    """Traces PROFILE_STEPS steps once the first has compiled (`runtime.profiling`)."""

    def __init__(self, profiler):
        self.profiler = profiler

    def on_step(self, run):
        if run.steps_run == 1:  # compiled: trace the next PROFILE_STEPS steps
            self.profiler.start()
        elif run.steps_run == 1 + PROFILE_STEPS and self.profiler.running:
            self.profiler.stop()

    def close(self):
        if self.profiler.running:
            self.profiler.stop()


class SpikeGuard(Hook):
    """Sets the step's limits from the rolling window, records each decision, and acts on
    a rejected step as the policy says (`training.spikes`): skip, stop, or roll back to the
    last checkpoint with the learning rate lowered."""

    def __init__(self, guarded: bool, checkpointer, restore):
        self.guarded, self.checkpointer, self.restore = guarded, checkpointer, restore
        self.in_a_row, self.norm_median, self.window = 0, None, None

    def begin(self, run):
        cfg = run.cfg
        self.window = spikes.Window.rebuild(cfg.spike_window, cfg.spike_z, run.losses,
                                            run.norms, set(run.gs.rejected))

    def before_step(self, run):
        if self.guarded:  # the guarded step when it has something to do; else the plain one
            loss_max, norm_max = (self.window.limits() if run.cfg.spike_policy != "none"
                                  else (math.inf, math.inf))
            run.guard = Guard.make(loss_max, norm_max, run.gs.lr_factor)

    def on_step(self, run):
        if run.accepted:
            self.in_a_row = 0
            self.window.add(run.loss, run.gnorm)
            if not math.isfinite(run.loss):  # unguarded and diverged: every later step too
                run.nonfinite_at = run.step
            # the gradient norm warns of a loss spike before the loss does
            elif (run.cfg.spike_policy == "none" and self.norm_median is not None
                  and run.gnorm > 5 * self.norm_median):
                run.note(f"step {run.step}: gradient norm {run.gnorm:.3g} is "
                         f"{run.gnorm / self.norm_median:.1f}x its recent median (possible "
                         "loss spike)")
            self.norm_median = float(np.median(run.norms[-50:]))
        else:
            run.action, event = self._reject(run)
            self.in_a_row += 1
            run.gs.rejected.append(run.step)
            run.gs.events.append(event)
            run.record.update(event=event["event"], action=run.action)

    def after_step(self, run):
        if run.action == "rollback":
            self._roll_back(run)
        elif self.in_a_row >= run.cfg.spike_window:
            run.note(f"the guard rejected {self.in_a_row} steps in a row: stopping (the run "
                     "has diverged, or --spike-z is too tight)")
            run.wants_stop = True
        elif run.action == "stop":
            run.wants_stop = True

    def _reject(self, run):
        """(action, event) for a step the guard rejected: what it was and what happens."""
        cfg, loss, gnorm, guard = run.cfg, run.loss, run.gnorm, run.guard
        finite = math.isfinite(loss) and math.isfinite(gnorm)
        action = cfg.spike_policy if finite and cfg.spike_policy != "none" else "skip"
        if action == "rollback" and not self.checkpointer.saved_any():
            action = "skip"  # nothing to roll back to yet
        event = {"step": run.step, "event": "spike" if finite else "nonfinite",
                 "action": action, "loss": loss, "grad_norm": gnorm,
                 "loss_max": float(guard.loss_max), "norm_max": float(guard.norm_max)}
        which = ("loss" if not loss <= guard.loss_max else "gradient norm") if finite else ""
        run.note(f"step {run.step}: " + (
            f"spike ({which} {loss if which == 'loss' else gnorm:.4g} > "
            f"{guard.loss_max if which == 'loss' else guard.norm_max:.4g})"
            if finite else f"non-finite loss {loss} / gradient norm {gnorm}") + f": {action}")
        return action, event

    def _roll_back(self, run):
        """Restore the last checkpoint, skip the batches since, lower the learning rate."""
        cfg, at, gs = run.cfg, run.step, run.gs
        self.checkpointer.wait()  # an asynchronous save in flight is the latest checkpoint
        run.step, run.state, meta = self.restore()
        run.losses, run.norms, run.val_curve, tokens_at, saved = resumed_metrics(meta)
        run.tokens_before += tokens_at - run.tokens  # the rate counts the steps computed
        run.tokens = tokens_at
        skipped = [run.step + saved.data_offset, run.data_step]  # data indices, inclusive
        # the rate is lowered from where it stood at the spike, not from the checkpoint's:
        # one saved after a bad update would restore it unchanged
        run.gs = spikes.GuardState(run.data_step + 1 - run.step,
                                   gs.lr_factor * cfg.rollback_lr_factor, saved.rejected,
                                   gs.events, gs.rollbacks + 1)
        run.gs.events.append({"step": at, "event": "rollback", "to": run.step,
                              "skipped_batches": skipped, "lr_factor": run.gs.lr_factor})
        run.write(run.gs.events[-1])
        run.note(f"rolled back to step {run.step}; batches {skipped[0]}..{skipped[1]} "
                 f"skipped, learning rate now x{run.gs.lr_factor:g}", "note")
        self.begin(run)  # the window of the restored history
        run.rolled_back = True
        if run.gs.rollbacks >= spikes.MAX_ROLLBACKS:
            run.note(f"{run.gs.rollbacks} rollbacks: stopping here; look at the run")
            run.abort = True


class Validator(Hook):
    """Validation loss every `eval_every` steps and at the last; the stop gap's time."""

    def __init__(self, eval_fn, whole, val_batches):
        self.eval_fn, self.whole, self.val_batches = eval_fn, whole, val_batches

    def loss(self, run) -> float:
        return evaluate(self.eval_fn, processes.replicated(self.whole(run.state)),
                        self.val_batches)

    def on_step(self, run):
        cfg = run.cfg
        if run.nonfinite_at is None and (run.step % cfg.eval_every == 0 or run.step == cfg.steps):
            val = self.loss(run)
            run.val_curve.append((run.step, val))
            run.record.update(val_loss=val, entropy_floor=run.floor, gap=val - run.floor)
            if (cfg.stop_gap is not None and val - run.floor <= cfg.stop_gap
                    and run.reached_at is None):
                run.reached_at = run.clock() - run.t_start


class MetricsWriter(Hook):
    """Writes the step's line of metrics.jsonl (`file`: the open file, or None)."""

    def __init__(self, file):
        self.file = file

    def on_step(self, run):
        run.write(run.record)

    def close(self):
        if self.file is not None:
            self.file.close()


class ProgressBar(Hook):
    """The progress bar (or a line every 10% off a terminal) with loss, gap and tokens/s."""

    def __init__(self, bar):
        self.bar = bar

    def begin(self, run):
        if run.start:
            self.bar.update(run.start, f"resumed at step {run.start}")

    def on_step(self, run):
        elapsed = run.clock() - run.t_start - run.compile_s
        rate = ((run.tokens - run.tokens_before) / elapsed
                if elapsed > 0 and run.steps_run > 1 else 0.0)
        gap = f" gap {run.val_curve[-1][1] - run.floor:.3f}" if run.val_curve else ""
        self.bar.update(run.step, f"loss {run.loss:.3f}{gap} | {rate:,.0f} tok/s")

    def close(self):
        self.bar.close()


class StopVote(Hook):
    """Process 0 decides whether to stop, and every process follows (`processes.agree`);
    `halt_after` stops as if interrupted, keeping the whole schedule for a later resume."""

    def __init__(self, halt_after: int | None):
        self.halt_after = halt_after

    def after_step(self, run):
        run.stop = processes.agree(run.reached_at is not None or run.nonfinite_at is not None
                                   or run.wants_stop)
        run.halted = (not run.stop and self.halt_after is not None
                      and run.step >= self.halt_after)


class CheckpointSaver(Hook):
    """Saves the canonical state every so many steps and at the last (`checkpoint.manager`
    decides when: `due`); metrics.jsonl is flushed first, so a resumed run finds every line
    up to its checkpoint."""

    def __init__(self, checkpointer):
        self.checkpointer = checkpointer

    def after_step(self, run):
        ckpt = self.checkpointer
        last = run.stop or run.halted or run.step == run.cfg.steps
        if ckpt is None or run.nonfinite_at is not None or not ckpt.due(run.step, last=last):
            return
        if run.metrics is not None:
            run.metrics.flush()
        ckpt.save(run.step, run.step_fn.canonical.to_canonical(run.state), run_meta(
            run.cfg, run.plan, run.batches.position(run.step + run.gs.data_offset),
            run.losses, run.norms, run.val_curve, run.tokens, guard=run.gs.to_json()))

    def close(self):
        if self.checkpointer is not None:
            self.checkpointer.close()  # an asynchronous save in flight is finished
