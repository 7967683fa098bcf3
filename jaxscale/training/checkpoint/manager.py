"""Checkpoints: a training state saved with Orbax in the canonical form, resumed in any plan.

A checkpoint directory holds one sub-directory per saved step, written by Orbax's
CheckpointManager:

    D/20/state   the canonical TrainState (jaxscale.parallel.canonical): whole tensors,
                 each a sharded jax.Array whose devices write their own shards
                 and a 32-bit digest of each of them, computed on the devices
    D/20/meta    JSON: the TrainConfig, the Plan it ran under, the model, the data
                 position (the global sample index, whatever the mesh), the metrics so far,
                 versions

(jaxscale.training.checkpoint.store reads a directory as it lies on disk: complete steps, the JSON,
file lists; checkpoint/tensors.py names the tensors and their digests, checkpoint/meta.py
writes the JSON.) Orbax writes a step into `D/20.orbax-checkpoint-tmp*` and
renames it when every process is done, so a process killed mid-save leaves the previous
step whole; the manager removes such leftovers when it opens D for writing. Old steps past
`keep` are renamed into `D/.deleted/` before they are removed (checkpoint_dir.empty_trash),
so no kill leaves a half-deleted step. Restoring reads each tensor straight into the new
plan's canonical shardings (Orbax reshards; it cannot reshape, which is what each layout's
canonical conversion is for), checks the digest (a deleted or truncated file can read back
as zeros), and `from_canonical` lays the state out for the new plan.

What must match to resume: everything that defines the run's numbers (model, optimizer,
learning rate and schedule, batch, seed, corpus, precision: `MUST_MATCH`). The plan may
change (mesh, ZeRO stage, micro-batches, pipeline schedule, recomputation): the state is
resharded and the data position carries over. There is no other random state to carry:
the batch order is a pure function of (seed, sample index) and the model has no dropout.
"""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxscale.training.checkpoint.store import (DIGEST, FORMAT, TRASH, CheckpointDamaged,
    CheckpointError, check_compatible, check_files, complete_steps, empty_trash, read_meta,
    write_manifest)
from jaxscale.training.checkpoint import crash
from jaxscale.training.checkpoint.meta import versions
from jaxscale.training.checkpoint.tensors import (digest, flat_items, unflat_items,
    use_orbax_array_handler)
from jaxscale.parallel.canonical import canonical_sharding
from jaxscale.runtime.signals import interrupts_held


class CheckpointWriteError(RuntimeError):
    """Writing a checkpoint failed (a full disk, a lost mount); the earlier ones are intact."""


@dataclass(frozen=True)
class CheckpointOptions:
    """Where and how often `train` saves, and whether it starts from the latest checkpoint."""

    directory: str
    every: int | None = None  # save every N steps (and at the last step); None: only resume
    keep: int | None = 3  # complete checkpoints kept (None: all)
    async_save: bool = False  # write in the background; training waits only for a copy
    resume: bool = False
    accept_lr_change: bool = False  # resume although --lr differs (the new one applies)

    def validate(self) -> None:
        if self.every is not None and self.every < 1:
            raise CheckpointError(f"--checkpoint-every must be a positive number of steps, "
                                  f"got {self.every}")
        if self.keep is not None and self.keep < 1:
            raise CheckpointError(f"--keep must be at least 1 checkpoint, got {self.keep}")
        check_directory(self.directory, self.resume, writing=self.every is not None)


def check_directory(directory, resume: bool, writing: bool = True) -> Path:
    """Refuse, before anything runs, a directory that cannot hold or provide checkpoints."""
    d = Path(directory)
    if d.exists() and not d.is_dir():
        raise CheckpointError(f"checkpoint directory {d} is a file; give a directory")
    if resume and not complete_steps(d):
        what = "does not exist" if not d.exists() else "holds no complete checkpoint"
        raise CheckpointError(f"cannot --resume: {d} {what}; start without --resume, or "
                              "point --checkpoint-dir at a directory a run saved into")
    if writing and not resume and complete_steps(d):
        raise CheckpointError(f"{d} already holds checkpoints (steps "
                              f"{', '.join(map(str, complete_steps(d)))}); pass --resume to "
                              "continue from the latest, or choose another --checkpoint-dir")
    if writing:
        parent = next(p for p in (d, *d.parents) if p.exists())
        try:  # a real probe (permissions alone do not stop root; a read-only mount does)
            if not parent.is_dir():
                raise NotADirectoryError(f"{parent} is a file")
            tempfile.TemporaryFile(dir=parent).close()  # created and gone at once
        except OSError as e:
            raise CheckpointError(f"checkpoint directory {d} is not writable ({e}); choose "
                                  "another --checkpoint-dir") from None
    return d


def check_resumable(directory, config: dict, accept_lr_change: bool = False) -> None:
    """Refuse at once (before any device starts) a directory whose latest checkpoint is
    another run's; a damaged latest one is left for `Checkpointer.restore` to skip."""
    steps = complete_steps(directory)
    try:
        meta = read_meta(directory, steps[-1])
    except CheckpointDamaged:
        return
    check_compatible(meta, config, accept_lr_change, Path(directory) / str(steps[-1]))


# --------------------------------------------------------------------------------------
# Saving and restoring
# --------------------------------------------------------------------------------------

class Checkpointer:
    """Saves a run's canonical state every `options.every` steps and restores the latest.

    All processes call it alike (Orbax coordinates them; only process 0 writes the JSON).
    Use it as a context manager, or call `close()`: an asynchronous save still being
    written is finished there, never dropped.
    """

    def __init__(self, options: CheckpointOptions, log=None):
        import orbax.checkpoint as ocp

        options.validate()
        self.options, self.log = options, log or (lambda msg: None)
        self.directory = Path(options.directory).absolute()
        self._ocp = ocp
        use_orbax_array_handler(ocp)  # small replicated tensors: no slice per replica
        self.manager = ocp.CheckpointManager(
            self.directory, item_names=("state", "meta"),
            options=ocp.CheckpointManagerOptions(
                max_to_keep=options.keep, create=options.every is not None,
                cleanup_tmp_directories=True, todelete_subdir=TRASH,
                enable_async_checkpointing=options.async_save))
        self._last_saved = None
        self._saves, self._crash = 0, crash.from_env()  # crash points: tests only
        self._empty_trash()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def due(self, step: int, last: bool) -> bool:
        every = self.options.every
        return every is not None and (step % every == 0 or last)

    def save(self, step: int, canonical_state, meta: dict) -> float:
        """Save `canonical_state` (a plan's `to_canonical` output) as `step`; the seconds
        training was held up (async: the copy to host memory and the digest). A Ctrl-C
        meanwhile is held until the step is written (sync) or handed to Orbax (async), then
        raised: the save is never cut in half."""
        t0 = time.perf_counter()
        items = flat_items(canonical_state)
        items.update(digest(items))  # dispatched; computed on the devices, not waited for
        meta = {**meta, "format": FORMAT, "step": step, "versions": versions()}
        with interrupts_held(f"the checkpoint of step {step}", self.log):
            self._save(step, items, meta)
        return time.perf_counter() - t0

    def _save(self, step: int, items: dict, meta: dict) -> None:
        ocp = self._ocp
        try:  # the previous asynchronous save first: its failure is its own
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise self._write_failed(self._last_saved, e) from e
        if self.options.async_save:  # a sync save recorded its files when it returned
            self._record_files()
        self._saves += 1
        self._crash_point("start")
        try:
            self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(items), meta=ocp.args.JsonSave(meta)), force=True)
        except Exception as e:  # noqa: BLE001  the disk's error, whichever layer raised it
            raise self._write_failed(step, e) from e
        self._last_saved = step
        self._crash_point("written")
        if not self.options.async_save:
            self._record_files()

    def _crash_point(self, phase: str) -> None:
        """Die here if $JAXSCALE_CHECKPOINT_CRASH names this phase of this save (tests)."""
        if self._crash is None:
            return
        if phase == "start" and self._crash.due("writing", self._saves):
            crash.die_while_writing(self.directory, self._crash.signal)
        elif self._crash.due(phase, self._saves):
            if phase == "written":
                self.manager.wait_until_finished()
            crash.die(self._crash.signal)

    def restore(self, canonical, config: dict):
        """(step, canonical state on this plan's devices, meta) of the latest checkpoint
        that reads back whole; a damaged one is named and the one before it tried.
        A checkpoint of another run (MUST_MATCH differs) is refused at once."""
        steps = complete_steps(self.directory)
        for step in reversed(steps):
            try:
                check_files(self.directory / str(step))
                meta = read_meta(self.directory, step)
                check_compatible(meta, config, self.options.accept_lr_change,
                                 self.directory / str(step))
                state = self._read_state(step, canonical.target, canonical.mesh)
                return step, state, meta
            except CheckpointDamaged as e:
                earlier = [s for s in steps if s < step]
                self.log(f"{e}; " + (f"falling back to step {earlier[-1]}" if earlier
                                     else "no earlier checkpoint to fall back to")
                         + self._set_aside(step))
        raise CheckpointError(f"no readable checkpoint in {self.directory} (steps tried: "
                              f"{', '.join(map(str, reversed(steps))) or 'none'})")

    def _set_aside(self, step: int) -> str:
        """A run that will save again moves a damaged step out of the way (renamed, kept
        for inspection), so that its own save of that step does not meet it."""
        if self.options.every is None:
            return ""
        aside = next(self.directory / f"{step}.damaged{n or ''}" for n in range(10**6)
                     if not (self.directory / f"{step}.damaged{n or ''}").exists())
        _barrier(f"jaxscale-read-{step}")  # every process has tried (and failed) to read it
        if jax.process_index() == 0:
            os.replace(self.directory / str(step), aside)
        _barrier(f"jaxscale-aside-{step}")
        self.manager.reload()
        return f" (moved aside to {aside})"

    def _read_state(self, step: int, target, mesh):
        ocp = self._ocp
        items = flat_items(target)
        replicated = canonical_sharding((), mesh)
        items.update({DIGEST + k: jax.ShapeDtypeStruct((), jnp.uint32, sharding=replicated)
                      for k in list(items)})
        try:
            got = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(items)))["state"]
        except Exception as e:  # Orbax and tensorstore raise many kinds; all mean the same
            first = (str(e).strip().splitlines() or [""])[0].split(" See full TensorStore")[0]
            raise CheckpointDamaged(f"checkpoint {self.directory / str(step)} is damaged: "
                                    f"{first[:200]}") from None
        tensors = {k: v for k, v in got.items() if not k.startswith(DIGEST)}
        have = jax.device_get(digest(tensors))
        want = jax.device_get({k: v for k, v in got.items() if k.startswith(DIGEST)})
        bad = [k[len(DIGEST):] for k in have if int(have[k]) != int(want[k])]
        if bad:
            raise CheckpointDamaged(f"checkpoint {self.directory / str(step)} is damaged: "
                                    f"tensor {bad[0]} does not match its saved digest"
                                    + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))
        return unflat_items(tensors, target)

    def wait(self) -> None:
        """Wait for a save in flight (CheckpointWriteError if it failed)."""
        try:
            self.manager.wait_until_finished()
            self._record_files()
        except Exception as e:  # noqa: BLE001  an asynchronous write that failed
            raise self._write_failed(self._last_saved, e) from e

    def saved_any(self) -> bool:
        """Whether a complete checkpoint exists to restore (after any save in flight)."""
        self.wait()
        return bool(complete_steps(self.directory))

    def close(self) -> None:
        """Wait for a save in flight, then release Orbax's threads."""
        try:  # the run is ending: a Ctrl-C here must not hide its result or its error
            with interrupts_held(f"the checkpoint of step {self._last_saved}", self.log,
                                 reraise=False):
                self.wait()
        finally:
            self.manager.close()

    def _record_files(self) -> None:
        """The file list of the last save, once Orbax has committed it (process 0)."""
        step = self._last_saved
        if step is not None and jax.process_index() == 0 and step in complete_steps(
                self.directory):
            write_manifest(self.directory / str(step))
        self._empty_trash()  # the steps this save pushed past `keep`

    def _empty_trash(self) -> None:
        if jax.process_index() == 0:
            empty_trash(self.directory)

    def _write_failed(self, step, error: Exception) -> CheckpointWriteError:
        kept = [s for s in complete_steps(self.directory) if step is None or s < step]
        first = (str(error).strip().splitlines() or [""])[0][:240]
        return CheckpointWriteError(
            f"saving checkpoint step {step} in {self.directory} failed ({type(error).__name__}: "
            f"{first}); " + (f"the checkpoint of step {kept[-1]} is intact" if kept
                             else "no earlier checkpoint exists"))


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)
