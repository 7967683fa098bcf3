"""The `jaxscale` command.

Every option is checked before JAX starts or compiles anything; a bad value costs one red
line that names it and the valid choices, and exit code 2.
"""
from __future__ import annotations

import argparse
import importlib
import math
import os
import re
import sys

EXIT_USAGE = 2  # a bad option value, one line on stderr
EXIT_FAILED = 1  # the run went wrong (e.g. the loss became NaN)
EXIT_INTERRUPTED = 130  # Ctrl-C: 128 + SIGINT, as shells report it

# The subcommands: each module in jaxscale/cli/commands/ has register(subparsers), which adds
# its parser (class _Parser, so errors are one line) and sets `run=handler`.
COMMAND_MODULES: tuple[str, ...] = ("train", "compare", "memory", "comm", "failures", "plan",
                                    "schedule", "launch", "checkpoint", "data", "bench")

class UsageError(ValueError):
    """A command-line value is invalid."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad value as one line and exit code 2, without the usage dump."""

    def error(self, message: str):
        _fail(message)


def _error(message: str) -> None:
    """One line on stderr, red on a terminal."""
    red = sys.stderr.isatty() and not os.environ.get("NO_COLOR")
    line = f"jaxscale: error: {message}"
    print(f"\033[31m{line}\033[0m" if red else line, file=sys.stderr)


def _fail(message: str):
    _error(message)
    raise SystemExit(EXIT_USAGE)


# The largest number an option takes unless it says otherwise: beyond it float arithmetic
# loses integers and products overflow, and no training job has that many of anything.
MAX_NUMBER = 1e15


def _number(kind=int, minimum=1, exclusive=False, maximum=MAX_NUMBER):
    """An argparse type: a finite `kind` >= minimum (> minimum if exclusive), <= maximum.

    An integer may be written as a float that is one ("1e9", "1024.0").
    """
    need = f"{'an integer' if kind is int else 'a number'} {'>' if exclusive else '>='} {minimum}"

    def parse(text: str):
        try:
            value = float(text) if kind is float else _integer(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {need}, got {text!r}") from None
        if not math.isfinite(value) or value < minimum or (exclusive and value == minimum):
            raise argparse.ArgumentTypeError(f"must be {need}, got {text}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {_short(maximum)}, got {text}")
        return value
    return parse


def _short(x: float) -> str:
    return f"{x:g}".replace("e+0", "e").replace("e+", "e")


def _integer(text: str):
    """int("1024"), and the whole numbers floats spell ("1e9"); nan and inf as floats."""
    try:
        return int(text)
    except ValueError:
        value = float(text)  # ValueError when it is no number at all
        if math.isfinite(value) and not value.is_integer():
            raise ValueError(f"{text} is not a whole number") from None
        return int(value) if math.isfinite(value) else value


# "-7e9", "-.5", "-inf": a value, not an option (argparse alone takes only "-5" and "-0.5").
_NEGATIVE_NUMBER = re.compile(r"^-(\d|\.\d|inf|nan)", re.IGNORECASE)


def _attach_negative_values(argv: list[str]) -> list[str]:
    """`--params -7e9` -> `--params=-7e9`, so that the option's own check reports the value."""
    out: list[str] = []
    for token in argv:
        if (out and _NEGATIVE_NUMBER.match(token) and out[-1].startswith("--")
                and "=" not in out[-1] and out[-1] != "--"):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def version_text() -> str:
    """'jaxscale 0.1.0 (jax 0.10.2, jaxlib 0.10.2)', from the installed packages' metadata."""
    from importlib import metadata

    def v(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            if name == "jaxscale":  # run from a checkout that is not installed
                from jaxscale import __version__
                return f"{__version__} (not installed)"
            return "not installed"
    return f"jaxscale {v('jaxscale')} (jax {v('jax')}, jaxlib {v('jaxlib')})"


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="jaxscale", description=(
        "Train a small transformer on the garden-world language and measure how "
        "training is spread over many devices."))
    p.add_argument("--version", action="version", version=version_text(),
                   help="print the versions of jaxscale, jax and jaxlib, and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    for name in COMMAND_MODULES:  # one module each (jaxscale/cli/commands/)
        importlib.import_module(f"jaxscale.cli.commands.{name}").register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if os.environ.get("JAXSCALE_LAUNCHED") or os.environ.get("JAXSCALE_SUPERVISED"):
        from jaxscale.runtime.processes import die_with_parent
        die_with_parent()  # a child of `jaxscale launch` or `train --max-restarts`
    try:
        args = build_parser().parse_args(_attach_negative_values(argv))
        args.argv = argv  # the command line as given (a supervisor runs it again)
        return args.run(args)
    except ValueError as e:  # our errors are ValueError subclasses with a complete message
        if type(e).__module__.startswith("jaxscale"):
            _fail(str(e))
        raise
    except OverflowError as e:  # a safety net: the options' limits should keep it away
        _fail(f"a number is too large to compute with ({e}): use smaller values")
    except KeyboardInterrupt:  # Ctrl-C outside a training loop: nothing to save
        print("jaxscale: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
