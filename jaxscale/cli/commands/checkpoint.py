"""`jaxscale checkpoint ls D`: the checkpoints a training run saved, complete or not.

    jaxscale checkpoint ls runs/ckpt
    jaxscale checkpoint ls runs/ckpt --json

Reads the directory and each checkpoint's JSON item only; JAX is never started and nothing
is changed (an incomplete step, left by a process killed mid-save, is removed by the next
run that saves into the directory).
"""
from __future__ import annotations

import json

from jaxscale.cli.main import UsageError


def register(subparsers) -> None:
    """Add the `checkpoint` subcommand (with its `ls` action) to jaxscale's parser."""
    p = subparsers.add_parser(
        "checkpoint", help="list a run's checkpoints: step, plan, size, complete or not",
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


def _cmd_ls(args) -> int:
    from pathlib import Path

    from jaxscale.training.checkpoint.store import listing
    from jaxscale.report import print_table, plural

    d = Path(args.directory)
    if not d.is_dir():
        raise UsageError(f"{d} is {'a file' if d.exists() else 'not there'}; give the "
                         "directory a run saved its checkpoints into (--checkpoint-dir)")
    try:
        rows = listing(d)
    except OSError as e:  # e.g. /proc: entries named like steps that cannot be read
        raise UsageError(f"cannot read {d}: {e.strerror or e} ({e.filename}); give the "
                         "directory a run saved its checkpoints into (--checkpoint-dir)") from None
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
