"""`compare --baseline FILE` and `--save-baseline FILE`: the command-line side of
jaxscale.compare.baseline (the options, the check before the run, the table after it)."""
from __future__ import annotations

import json
import sys

from jaxscale.cli.paths import output_file
from jaxscale.files import write_text_atomically
from jaxscale.report import print_table


def add_arguments(p) -> None:
    p.add_argument("--baseline", default=None, metavar="FILE",
                   help="a previous run's compare.json (or --save-baseline file) of the same "
                        "model, devices, steps, batch and platform: every strategy both have "
                        "must follow its losses within this run's bound and send and hold "
                        "exactly its bytes; what moved is listed, and the exit code is 1")
    p.add_argument("--save-baseline", type=lambda t: output_file(t, ("json",)), default=None,
                   metavar="FILE", help="also copy this run's compare.json to FILE (.json), "
                                        "to check later runs against with --baseline")


def load(args, on_cpu: bool):
    """The baseline (or None), checked against this job before anything compiles."""
    from jaxscale.compare import baseline
    if args.abstract and (args.baseline or args.save_baseline):
        raise baseline.BaselineError("--baseline and --save-baseline keep a trained run's "
                                     "losses, bytes and memory; drop --abstract")
    if args.baseline is None:
        return None
    platform = "cpu" if on_cpu else (None if args.platform == "auto" else args.platform)
    return baseline.load(args.baseline, {"model": args.model, "devices": args.devices,
                                         "steps": args.steps, "batch_size": args.batch_size,
                                         "platform": platform,
                                         "precision": args.precision or "fp32"})


def check(base, result: dict) -> None:
    """Compare the finished run with the baseline: result["baseline"], and a table."""
    if base is None:
        return
    from jaxscale.compare import baseline
    result["baseline"] = report = baseline.moved(base, result)
    if report["only_in_baseline"]:
        print(f"baseline: not run this time: {', '.join(report['only_in_baseline'])}",
              file=sys.stderr)
    if not report["moved"]:
        print(f"baseline: {len(report['compared'])} strategies unchanged (losses within "
              f"{report['tolerance']:.1e}, bytes and memory equal)", file=sys.stderr)
        return
    print_table(f"what moved since the baseline ({len(report['moved'])})",
                ["strategy", "what", "baseline", "now"],
                [[m["strategy"], m["what"], _show(m["baseline"]), _show(m["now"])]
                 for m in report["moved"]], file=sys.stderr)


def save(args, out) -> None:
    """--save-baseline: this run's compare.json copied whole (a Ctrl-C leaves no half file;
    FILE may be that compare.json itself)."""
    if args.save_baseline is not None:
        write_text_atomically(args.save_baseline, (out / "compare.json").read_text())


def _show(x) -> str:
    if isinstance(x, float) and not x.is_integer():
        return f"{x:.3e}"
    return f"{int(x):,}" if isinstance(x, (int, float)) else json.dumps(x)
