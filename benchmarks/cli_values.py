"""Benchmark: every option of every subcommand, given values a user should not give.

Issue 33's survey fed 245 bad or edge-case inputs to the command line; 198 were refused
cleanly. This rebuilds a survey of that kind from the parsers themselves, so that it can be
run on any commit: for each subcommand's options (walked from `build_parser()`), values
that are out of the option's kind (a word for a number, a negative count, nan, a huge
number, an empty string, a choice that is not one, an unwritable path), each parsed in
this process exactly as `jaxscale` parses it (nothing is run). Each input ends one of
three ways:

    refused   exit 2 and one line on stderr that quotes the value or names the option
    accepted  parsed (the command would run with it: right for some, e.g. 0 minutes)
    broken    anything else: a traceback, several lines, a line that names neither

    PYTHONPATH=. python benchmarks/cli_values.py [--label NAME]

Writes benchmarks/results/cli_values[-LABEL].json.
"""
import argparse
import contextlib
import io
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from jaxscale.cli import main as cli  # noqa: E402

NUMBER_VALUES = ("-1", "0", "nan", "inf", "abc", "1e30", "")
PATH_VALUES = ("/proc/jaxscale/x", "")
# what each command (or action) needs besides the option under test to parse at all
REQUIRED = {"plan": ["--params", "7e9", "--devices", "8"], "memory": ["--params", "7e9"],
            "comm": ["--params", "7e9"], "launch": ["--processes", "2",
                                                    "--devices-per-process", "1"]}
TAIL = {"launch": ["--", "train"], "checkpoint ls": ["d"], "checkpoint prune": ["d"],
        "checkpoint rm": ["d", "1"]}


def commands(parser, prefix=()):
    """(argv prefix, parser) for every leaf subcommand under `parser`."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield list(prefix), parser
        return
    for name, child in subs[0].choices.items():
        yield from commands(child, (*prefix, name))


def bad_values(action) -> tuple[str, ...]:
    if action.choices:
        return ("nonsense",)
    name = getattr(action.type, "__name__", "") or type(action.type).__name__
    if "output" in name or "path" in name:
        return PATH_VALUES
    return NUMBER_VALUES if action.type is not None else ()


def attempt(argv: list[str], value: str, option: str) -> str:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            cli.build_parser().parse_args(cli._attach_negative_values(argv))
            return "accepted"
        except SystemExit as e:
            lines = err.getvalue().strip().splitlines()
            named = value and repr(value) in err.getvalue() or value in err.getvalue()
            ok = e.code == 2 and len(lines) == 1 and (named or option in lines[0])
            return "refused" if ok else "broken"
        except Exception:  # noqa: BLE001  what a user would see as a traceback
            return "broken"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    rows, t0 = [], time.perf_counter()
    for prefix, parser in commands(cli.build_parser()):
        key = " ".join(prefix)
        for action in parser._actions:
            if not action.option_strings or action.nargs == 0:
                continue
            option = action.option_strings[-1]
            for value in bad_values(action):
                argv = [*prefix, *REQUIRED.get(prefix[0], []), option, value,
                        *TAIL.get(key, TAIL.get(prefix[0], []))]
                rows.append({"command": key, "option": option, "value": value,
                             "outcome": attempt(argv, value, option)})
    count = {k: sum(r["outcome"] == k for r in rows) for k in ("refused", "accepted", "broken")}
    name = "cli_values" + (f"-{args.label}" if args.label else "")
    (ROOT / "benchmarks" / "results" / f"{name}.json").write_text(json.dumps(
        {"benchmark": "cli_values", "label": args.label, "inputs": len(rows), **count,
         "wall_s": round(time.perf_counter() - t0, 1), "date": time.strftime("%Y-%m-%d"),
         "rows": rows}, indent=1) + "\n")
    print(f"{len(rows)} inputs: {count['refused']} refused cleanly, {count['accepted']} "
          f"accepted, {count['broken']} broken")
    for r in rows:
        if r["outcome"] == "broken":
            print(f"  broken: jaxscale {r['command']} {r['option']} {r['value']!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
