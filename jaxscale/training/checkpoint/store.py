"""A checkpoint directory as it lies on disk: its steps, their JSON, their file lists.

    D/20/                      a complete step (Orbax renamed it into place)
    D/20/meta/metadata         its JSON item (jaxscale.training.checkpoint.meta.run_meta)
    D/20/jaxscale-files.json   every file of the step and its size, written after the commit
    D/24.orbax-checkpoint-tmp  a save that never finished (a kill mid-save): never used
    D/16.damaged               a damaged step a later run moved aside
    D/.deleted/12              an old step past --keep: renamed here in one step, then
                               emptied (a kill mid-delete leaves no half step among the steps)

Also what a resumed run must share with the JSON (`check_compatible`). Plain files only:
`jaxscale checkpoint ls` never starts JAX. What the JSON holds is written by
checkpoint/meta.py, and the tensors are read back by name in checkpoint/tensors.py.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from jaxscale.files import write_text_atomically

FORMAT = 1
# TrainConfig fields a resumed run must share with the checkpoint (the plan's may differ)
MUST_MATCH = ("model", "optimizer", "lr", "lr_schedule", "warmup", "steps", "batch_size",
              "seed", "precision", "optimizer_state_dtype", "fp8_block", "fp8_head",
              "fp8_history", "n_train_docs", "n_val_docs")
# fields added after checkpoints were written without them: what those runs had
BEFORE = {"optimizer_state_dtype": "fp32", "fp8_block": 128, "fp8_head": False,  # (fp8.BLOCK)
          "fp8_history": 16}  # (fp8_history.HISTORY)
NO_FLAG = ("n_train_docs", "n_val_docs")  # set only through the Python API (TrainConfig)
TMP_MARK = ".orbax-checkpoint-tmp"
MANIFEST = "jaxscale-files.json"
TRASH = ".deleted"  # Orbax's todelete_subdir: old steps are renamed here, then removed
DIGEST = "digest."  # the name prefix of each tensor's digest item (checkpoint/tensors.py)


class CheckpointError(ValueError):
    """A checkpoint directory or option that cannot be used (exit 2, nothing written)."""


class CheckpointDamaged(CheckpointError):
    """A checkpoint whose files are missing, truncated or do not match their digest."""


def check_compatible(meta: dict, config: dict, accept_lr_change: bool, where) -> None:
    """Refuse a checkpoint of another run, naming the first field that differs."""
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {where} has format {meta.get('format')!r}; this "
                              f"jaxscale reads format {FORMAT}")
    saved = meta["config"]
    for field in MUST_MATCH:
        if field == "lr" and accept_lr_change:
            continue
        was = saved.get(field, BEFORE.get(field))
        if was != config.get(field, BEFORE.get(field)):
            flag = f"--{field.replace('_', '-')}"
            fix = (f"set TrainConfig.{field}={was!r}" if field in NO_FLAG else
                   f"{'pass' if was else 'leave out'} {flag}" if isinstance(was, bool) else
                   f"use {flag} {was}")
            hint = (" (or pass --accept-lr-change to continue with the new one)"
                    if field == "lr" else "")
            raise CheckpointError(
                f"checkpoint {where} was written with {field}={was!r} but this "
                f"run has {field}={config.get(field)!r}; {fix}{hint}")


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
    write_text_atomically(step_dir / MANIFEST, json.dumps({"files": files}))


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
    trash = Path(directory) / TRASH
    for child in (list(trash.iterdir()) if trash.is_dir() else []):
        shutil.rmtree(child, ignore_errors=True)


def remove_step(directory, path) -> None:
    """Delete one step's directory (`jaxscale checkpoint prune / rm`) the way the saver's
    old steps go: renamed into `TRASH` in one atomic step (what Orbax does with a step past
    `keep`), then removed by `empty_trash`, so that no kill leaves half a step listed."""
    trash = Path(directory) / TRASH
    trash.mkdir(exist_ok=True)
    name = Path(path).name
    target = next(trash / f"{name}{f'.{n}' if n else ''}" for n in range(10**6)
                  if not (trash / f"{name}{f'.{n}' if n else ''}").exists())
    os.replace(path, target)
    empty_trash(directory)


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
