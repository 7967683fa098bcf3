"""`jaxscale checkpoint ls D`: the checkpoints a training run saved, complete or not;
`prune` and `rm` delete some of them.

    jaxscale checkpoint ls runs/ckpt
    jaxscale checkpoint ls runs/ckpt --json
    jaxscale checkpoint prune runs/ckpt --keep 2   all but the newest 2 complete steps
    jaxscale checkpoint rm runs/ckpt 20            step 20 (complete or not)

Reads the directory and each checkpoint's JSON item only; JAX is never started. `ls`
changes nothing (an incomplete step, left by a process killed mid-save, is removed by the
next run that saves into the directory); `prune` and `rm` delete a step as the saver deletes
its old ones (store.remove_step: renamed aside in one step, then removed). Do not run them
on a directory a run is saving into.
"""
from __future__ import annotations

import json

from jaxscale.cli.main import COMMANDS, UsageError, _number


def register(subparsers) -> None:
    """Add the `checkpoint` subcommand (actions ls, prune, rm) to jaxscale's parser."""
    p = subparsers.add_parser(
        "checkpoint", help=COMMANDS["checkpoint"],
        description="Inspect a checkpoint directory written by `jaxscale train "
                    "--checkpoint-dir`.")
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    ls = actions.add_parser("ls", help="every saved step with its plan, bytes and state",
                            description="List every step in DIR: complete or not (a save "
                                        "that never finished), the plan and processes that "
                                        "wrote it, its data position and its size on disk.")
    ls.add_argument("directory", metavar="DIR", help="the --checkpoint-dir of a run")
    ls.add_argument("--json", action="store_true",
                    help="print one JSON object with every figure instead of a table")
    ls.set_defaults(run=_cmd_ls)
    prune = actions.add_parser("prune", help="delete all but the newest K complete steps",
                               description="Delete every step in DIR but the newest K "
                                           "complete ones; incomplete and damaged steps go "
                                           "too, each named.")
    prune.add_argument("directory", metavar="DIR", help="the --checkpoint-dir of a run")
    prune.add_argument("--keep", type=_number(), required=True, metavar="K",
                       help="complete steps to keep, the newest (at least 1)")
    rm = actions.add_parser("rm", help="delete one step", description="Delete step STEP "
                            "of DIR (every directory of that step: complete, incomplete or "
                            "damaged).")
    rm.add_argument("directory", metavar="DIR", help="the --checkpoint-dir of a run")
    rm.add_argument("step", type=_number(minimum=0), metavar="STEP", help="the step to delete")
    for p in (prune, rm):
        p.add_argument("--json", action="store_true",
                       help="print one JSON object naming what was removed")
    prune.set_defaults(run=_cmd_prune)
    rm.set_defaults(run=_cmd_rm)


def _rows(directory: str):
    """(Path, listing) of a checkpoint directory; UsageError if it is not one to read."""
    from pathlib import Path

    from jaxscale.training.checkpoint.store import listing

    d = Path(directory)
    if not d.is_dir():
        raise UsageError(f"{d} is {'a file' if d.exists() else 'not there'}; give the "
                         "directory a run saved its checkpoints into (--checkpoint-dir)")
    try:
        return d, listing(d)
    except OSError as e:  # e.g. /proc: entries named like steps that cannot be read
        raise UsageError(f"cannot read {d}: {e.strerror or e} ({e.filename}); give the "
                         "directory a run saved its checkpoints into (--checkpoint-dir)") from None


def _remove(d, rows: list[dict], kept: list[int], as_json: bool) -> int:
    """Delete `rows`' directories, then say what went (one line each, or one JSON object)."""
    from jaxscale.training.checkpoint.store import remove_step
    from jaxscale.report import plural

    for i, r in enumerate(rows):
        try:
            remove_step(d, r["path"])
        except OSError as e:  # e.g. a folder this user cannot write: the error names what went
            went = f" (removed before it: step {', '.join(str(x['step']) for x in rows[:i])})"
            raise OSError(e.errno, f"{e.strerror or e}{went if i else ''}", e.filename) from None
    removed = [{"step": r["step"], "path": r["path"], "complete": r["complete"],
                "bytes": r["bytes"]} for r in rows]
    if as_json:
        print(json.dumps({"directory": str(d), "removed": removed, "kept": kept}))
        return 0
    for r in rows:
        what = ("complete" if r["complete"] else
                "damaged" if r.get("damaged") else "incomplete (a save that never finished)")
        print(f"removed step {r['step']}, {what}: {r['path']} ({r['bytes']:,} bytes)")
    print(f"{d}: removed {plural(len(rows), 'step directory', 'step directories')}; "
          f"kept {plural(len(kept), 'complete step')}"
          + (f" ({', '.join(map(str, kept))})" if kept else ""))
    return 0


def _cmd_prune(args) -> int:
    d, rows = _rows(args.directory)
    complete = sorted({r["step"] for r in rows if r["complete"]})
    kept = complete[-args.keep:]
    gone = [r for r in rows if not (r["complete"] and r["step"] in kept)]
    return _remove(d, gone, kept, args.json)


def _cmd_rm(args) -> int:
    d, rows = _rows(args.directory)
    gone = [r for r in rows if r["step"] == args.step]
    if not gone:
        steps = ", ".join(map(str, sorted({r["step"] for r in rows}))) or "none"
        raise UsageError(f"step {args.step} is not in {d}; its steps: {steps}")
    kept = sorted({r["step"] for r in rows if r["complete"] and r["step"] != args.step})
    return _remove(d, gone, kept, args.json)


def _cmd_ls(args) -> int:
    from jaxscale.report import print_table, plural

    d, rows = _rows(args.directory)
    if args.json:
        print(json.dumps({"directory": str(d), "checkpoints": rows}))
        return 0
    if not rows:
        print(f"{d}: no checkpoints")
        return 0

    def state(r):
        return "complete" if r["complete"] else ("damaged" if r.get("damaged") else "incomplete")
    table = [[r["step"], state(r), r.get("plan", "-"), r.get("processes", "-"),
              r.get("samples_seen", "-"), f"{r['bytes']:,}"] for r in rows]
    done = sum(r["complete"] for r in rows)
    print_table(f"{d}: {plural(done, 'complete checkpoint')}, "
                f"{len(rows) - done} incomplete or damaged",
                ["step", "state", "plan", "processes", "samples seen", "bytes"], table)
    for r in rows:
        if r.get("damaged"):
            print(r["damaged"])
    return 0
