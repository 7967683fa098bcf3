"""The `jaxscale` command.

Every option is checked before JAX starts or compiles anything; a bad value costs one red
line that names it and the valid choices, and exit code 2.
"""
from __future__ import annotations

import argparse
import difflib
import importlib
import math
import os
import re
import sys

EXIT_USAGE = 2  # a bad option value, one line on stderr
EXIT_FAILED = 1  # the run went wrong (e.g. the loss became NaN)
EXIT_INTERRUPTED = 130  # Ctrl-C: 128 + SIGINT, as shells report it

# The subcommands, each with its line in `jaxscale --help`. Each has a module in
# jaxscale/cli/commands/ with register(subparsers), which adds its parser (class _Parser, so
# errors are one line) with that line and sets `run=handler`. A command line imports only
# its own command's module (build_parser): the calculators (memory, comm, failures, plan,
# schedule, checkpoint) then start without importing JAX, Flax, Optax and Orbax, which the
# training commands' options need (about a second on 2 cores).
COMMANDS: dict[str, str] = {
    "train": "train a model on the garden corpus",
    "compare": "run every parallel strategy side by side, measured vs predicted",
    "memory": "bytes per device: model states under ZeRO, activations, recomputation, "
              "LoRA/QLoRA",
    "comm": "communication per step: ring all-reduce vs parameter server, "
            "tensor/pipeline/data parallel volumes",
    "failures": "cluster MTBF, optimal checkpoint interval (Young, Daly), wasted time, "
                "asynchronous checkpoints",
    "plan": "search layouts (dp, tp, pp, v, cp, ZeRO, recompute, micro-batch) that fit, "
            "ranked by predicted step time",
    "schedule": "simulate a pipeline schedule: its chart, bubble and activations",
    "launch": "run train or compare as one job of several local processes",
    "checkpoint": "list a run's checkpoints (step, plan, size, complete or not); prune or "
                  "remove them",
    "data": "clean a corpus: quality filters, decontamination, MinHash + LSH near-duplicate "
            "removal",
    "bench": "time a training step: tokens/s and MFU",
    "explain": "where every tensor of a layout lives, and what fills its memory"}
COMMAND_MODULES: tuple[str, ...] = tuple(COMMANDS)

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


def build_parser(commands=None) -> argparse.ArgumentParser:
    """The `jaxscale` parser with every command's (`commands`: only these commands' modules
    imported and their options known; the others listed by name and line, for --help and
    'did you mean')."""
    p = _Parser(prog="jaxscale", description=(
        "Train a small transformer on the garden-world language and measure how "
        "training is spread over many devices."))
    p.add_argument("--version", action="version", version=version_text(),
                   help="print the versions of jaxscale, jax and jaxlib, and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = False  # none given: main prints the usage and the commands

    for name in COMMAND_MODULES:  # one module each (jaxscale/cli/commands/)
        if commands is None or name in commands:
            importlib.import_module(f"jaxscale.cli.commands.{name}").register(sub)
        else:
            sub.add_parser(name, help=COMMANDS[name])
    for parser in _parsers(p):
        _show_defaults(parser)
    return p


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """`parser` and every subcommand's parser under it, nested ones included."""
    out = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):  # aliases: once each
                out += _parsers(child)
    return out


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Append '(default X)' to the help of every option with a value that does not say its
    default already (flags, whose default is off, and options without one are left alone)."""
    for a in parser._actions:
        if (not a.option_strings or a.help == argparse.SUPPRESS or a.nargs == 0
                or a.default in (None, argparse.SUPPRESS, "") or a.default in ((), [])
                or "default" in (a.help or "")):
            continue
        shown = str(a.default).replace("%", "%%")  # help strings are %-formatted
        a.help = f"{a.help} (default {shown})" if a.help else f"default {shown}"


def _options(parser: argparse.ArgumentParser) -> list[str]:
    """The long options `parser` and the parsers under it take."""
    return sorted({o for p in _parsers(parser) for o in p._option_string_actions
                   if o.startswith("--")})


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The parser of one subcommand."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _command(argv: list[str]) -> str | None:
    """The command a command line runs: its first word that is not an option."""
    return next((t for t in argv if not t.startswith("-")), None)


def _check_options(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """A misspelt long option fails with its nearest match: 'unrecognized argument --stpes;
    did you mean --steps?' (argparse alone would not say, nor name the command's options).
    A unique prefix of an option is taken, as argparse takes it."""
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    command = _command(argv)
    if sub is None or command not in sub.choices:
        return
    if any(a.nargs == argparse.REMAINDER for a in sub.choices[command]._actions):
        return  # launch: what follows its options is another command's, checked by it
    known = _options(sub.choices[command])
    for token in argv[argv.index(command) + 1:]:
        if token == "--":
            return
        name = token.split("=", 1)[0]
        if not name.startswith("--") or any(o.startswith(name) for o in known):
            continue
        near = difflib.get_close_matches(name, known, n=1)
        _fail(f"unrecognized argument {name}"
              + (f"; did you mean {near[0]}?" if near else f"; see jaxscale {command} --help"))


def main(argv: list[str] | None = None) -> int:
    """Run a command; output cut short by its reader (`jaxscale plan ... | head -1`) ends it
    quietly with exit 1, as Python's documentation recommends (no traceback)."""
    try:
        code = _main(argv)
        sys.stdout.flush()  # a closed pipe raises here, not at the interpreter's exit
        return code
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)  # the exit's own flush must not fail
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_FAILED


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if os.environ.get("JAXSCALE_LAUNCHED") or os.environ.get("JAXSCALE_SUPERVISED"):
        from jaxscale.runtime.processes import die_with_parent
        die_with_parent()  # a child of `jaxscale launch` or `train --max-restarts`
    try:
        argv_ = _attach_negative_values(argv)
        parser = build_parser(commands=[_command(argv_)])
        _check_options(parser, argv_)
        args = parser.parse_args(argv_)
        if getattr(args, "config", None):  # the file's options under the command line's
            from jaxscale.cli import config_file
            command, sub = args.command, _subparser(parser, args.command)
            args = config_file.reparse(sub, argv_[argv_.index(command) + 1:], args.config)
            args.command = command
        if args.command is None:  # bare `jaxscale`: what it takes, on stderr
            print(parser.format_help(), end="", file=sys.stderr)
            return EXIT_USAGE
        args.argv = argv  # the command line as given (a supervisor runs it again)
        return args.run(args)
    except ValueError as e:  # our errors are ValueError subclasses with a complete message
        if type(e).__module__.startswith("jaxscale"):
            _fail(str(e))
        raise
    except BrokenPipeError:
        raise  # main() ends a closed pipe quietly
    except OSError as e:  # the file system refused (permissions, a full disk): one line
        _error(f"{e.strerror or e}: {e.filename}" if e.filename else str(e))
        return EXIT_FAILED
    except OverflowError as e:  # a safety net: the options' limits should keep it away
        _fail(f"a number is too large to compute with ({e}): use smaller values")
    except KeyboardInterrupt:  # Ctrl-C outside a training loop: nothing to save
        print("jaxscale: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
