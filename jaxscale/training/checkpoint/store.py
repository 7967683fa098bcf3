"""A checkpoint directory as it lies on disk: its steps, their JSON, their file lists.

    D/20/                      a complete step (Orbax renamed it into place)
    D/20/meta/metadata         its JSON item (jaxscale.training.checkpoint.manager.run_meta)
    D/20/jaxscale-files.json   every file of the step and its size, written after the commit
    D/24.orbax-checkpoint-tmp  a save that never finished (a kill mid-save): never used
    D/16.damaged               a damaged step a later run moved aside
    D/.deleted/12              an old step past --keep: renamed here in one step, then
                               emptied (a kill mid-delete leaves no half step among the steps)

Also what the JSON holds (`run_meta`) and what a resumed run must share with it
(`check_compatible`). Plain files only (`jaxscale checkpoint ls` never starts JAX),
except `read_canonical`, which reads the tensors back by name for tests and tools.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

FORMAT = 1
# TrainConfig fields a resumed run must share with the checkpoint (the plan's may differ)
MUST_MATCH = ("model", "optimizer", "lr", "lr_schedule", "warmup", "steps", "batch_size",
              "seed", "precision", "n_train_docs", "n_val_docs")
NO_FLAG = ("n_train_docs", "n_val_docs")  # set only through the Python API (TrainConfig)
TMP_MARK = ".orbax-checkpoint-tmp"
MANIFEST = "jaxscale-files.json"
TRASH = ".deleted"  # Orbax's todelete_subdir: old steps are renamed here, then removed
DIGEST = "digest."  # the name prefix of each tensor's digest item (jaxscale.training.checkpoint.manager)


class CheckpointError(ValueError):
    """A checkpoint directory or option that cannot be used (exit 2, nothing written)."""


class CheckpointDamaged(CheckpointError):
    """A checkpoint whose files are missing, truncated or do not match their digest."""


def run_meta(cfg, plan, samples_seen: int, losses, norms, val_curve, tokens,
             model=None, guard: dict | None = None) -> dict:
    """The JSON item beside a checkpoint's tensors: the run (a TrainConfig), its plan, the
    model, the data position (the global sample index: mesh-independent), the metrics so
    far, the spike guard's state (jaxscale.training.spikes.GuardState). (There is no random state
    to add: see jaxscale.training.checkpoint.manager.)"""
    from dataclasses import asdict

    import jax

    from jaxscale.model.config import preset
    return {
        "config": asdict(cfg), "plan": plan.as_dict(), "plan_layout": plan.layout(),
        "model": asdict(model or preset(cfg.model)),  # `model`: a ModelConfig, not a preset
        "data": {"samples_seen": samples_seen, "batch_size": cfg.batch_size,
                 "order": "a shuffle of (seed, epoch) per epoch (jaxscale.data.sampler)"},
        "random": "the seed alone: batch order is a function of (seed, sample index), and "
                  "the model has no dropout",
        "metrics": {"loss_curve": list(losses), "grad_norms": list(norms),
                    "val_curve": [list(v) for v in val_curve], "tokens_seen": tokens},
        "guard": guard or {}, "processes": jax.process_count(), "devices": plan.n_devices}


def check_compatible(meta: dict, config: dict, accept_lr_change: bool, where) -> None:
    """Refuse a checkpoint of another run, naming the first field that differs."""
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {where} has format {meta.get('format')!r}; this "
                              f"jaxscale reads format {FORMAT}")
    saved = meta["config"]
    for field in MUST_MATCH:
        if field == "lr" and accept_lr_change:
            continue
        if saved.get(field) != config.get(field):
            fix = (f"set TrainConfig.{field}={saved.get(field)!r}" if field in NO_FLAG else
                   f"use --{field.replace('_', '-')} {saved.get(field)}")
            hint = (" (or pass --accept-lr-change to continue with the new one)"
                    if field == "lr" else "")
            raise CheckpointError(
                f"checkpoint {where} was written with {field}={saved.get(field)!r} but this "
                f"run has {field}={config.get(field)!r}; {fix}{hint}")


def versions() -> dict[str, str]:
    import flax
    import jax
    import optax
    import orbax.checkpoint as ocp

    from jaxscale import __version__
    return {"jaxscale": __version__, "jax": jax.__version__, "jaxlib": jax.lib.__version__,
            "flax": flax.__version__, "optax": optax.__version__, "orbax": ocp.__version__}


def complete_steps(directory) -> list[int]:
    """The steps with a complete (renamed, committed) checkpoint in `directory`, ascending."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted(int(p.name) for p in d.iterdir()
                  if p.is_dir() and p.name.isdigit() and (p / "_CHECKPOINT_METADATA").exists())


def read_meta(directory, step: int) -> dict:
    """The JSON item of one checkpoint (CheckpointDamaged if it is missing or unreadable)."""
    path = Path(directory) / str(step) / "meta" / "metadata"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointDamaged(f"checkpoint {path.parent.parent} is damaged: cannot read "
                                f"{path} ({type(e).__name__})") from None


def write_manifest(step_dir: Path) -> None:
    """Record every file of a committed checkpoint with its size (written once, atomically,
    by process 0 after Orbax has renamed the step into place): a later deleted or truncated
    file is then named before Orbax reads anything."""
    if (step_dir / MANIFEST).exists():
        return
    files = {str(f.relative_to(step_dir)): f.stat().st_size
             for f in sorted(step_dir.rglob("*")) if f.is_file()}
    tmp = step_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"files": files}))
    os.replace(tmp, step_dir / MANIFEST)


def check_files(step_dir: Path) -> None:
    """CheckpointDamaged naming the first file that is missing or not its recorded size
    (a checkpoint without a manifest, killed before it was written, is not checked here)."""
    try:
        files = json.loads((step_dir / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return
    except (OSError, ValueError, KeyError):
        raise CheckpointDamaged(f"checkpoint {step_dir} is damaged: its file list "
                                f"{MANIFEST} cannot be read") from None
    for name, size in files.items():
        f = step_dir / name
        if not f.is_file():
            raise CheckpointDamaged(f"checkpoint {step_dir} is damaged: {name} is missing")
        if f.stat().st_size != size:
            raise CheckpointDamaged(f"checkpoint {step_dir} is damaged: {name} has "
                                    f"{f.stat().st_size:,} bytes, {size:,} when saved")


def empty_trash(directory) -> None:
    """Remove the old steps Orbax renamed into `TRASH` (each child, never TRASH itself,
    which Orbax may be renaming into at this moment). Deleting in place would let a kill
    leave a half-deleted step that reads as damaged; a rename is atomic, and a kill in
    here only leaves part of a step that no listing looks at."""
    import shutil
    trash = Path(directory) / TRASH
    for child in (list(trash.iterdir()) if trash.is_dir() else []):
        shutil.rmtree(child, ignore_errors=True)


def dir_bytes(path: Path) -> int:
    """Bytes of every file below `path`."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def listing(directory) -> list[dict]:
    """Every step directory in `directory`: step, complete or not, plan, bytes on disk."""
    d = Path(directory)
    rows = []
    for p in sorted(d.iterdir() if d.is_dir() else [], key=lambda p: p.name):
        name = p.name.split(TMP_MARK)[0].split(".damaged")[0]
        if not (p.is_dir() and name.isdigit()):
            continue
        row = {"step": int(name), "path": str(p), "bytes": dir_bytes(p),
               "complete": p.name == name and (p / "_CHECKPOINT_METADATA").exists()}
        if ".damaged" in p.name:
            row["damaged"] = f"checkpoint {p} was found damaged and moved aside by a later run"
        if row["complete"]:
            try:
                check_files(p)
                meta = read_meta(d, int(name))
                row.update(plan=meta["plan_layout"], model=meta["config"]["model"],
                           processes=meta["processes"], devices=meta["devices"],
                           samples_seen=meta["data"]["samples_seen"])
            except CheckpointDamaged as e:
                row.update(complete=False, damaged=str(e))
            except KeyError as e:
                row.update(complete=False, damaged=f"checkpoint {p} is damaged: its JSON item "
                                                   f"has no {e} field")
        rows.append(row)
    return sorted(rows, key=lambda r: (r["step"], r["complete"]))


def read_canonical(directory, step: int) -> dict:
    """Every tensor of one checkpoint as host arrays, by dotted name (for tests and tools)."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    path = Path(directory).absolute() / str(step) / "state"
    here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    with ocp.StandardCheckpointer() as ckptr:  # onto one device, whatever mesh wrote it
        meta = ckptr.metadata(path)
        tree = getattr(meta, "item_metadata", None) or meta
        target = {k: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=here)
                  for k, m in dict(tree).items()}
        items = ckptr.restore(path, target)
    return {k: np.asarray(v) for k, v in items.items() if not k.startswith(DIGEST)}
