"""`--config FILE.toml` for `train` and `compare`, and the configuration a run writes.

Every long option of the command is a key, spelt as on the command line without the dashes
(`batch-size = 32`; `batch_size` is taken too), with TOML's own types: a number, a string, a
boolean for a flag, a list of strings for a repeatable option (`strategy = ["dp=2,tp=2",
"pp=2,micro_batches=4"]`). Each value goes through the option's own check, so a file is
refused exactly where the command line would be, with the key and its line named. The
command line wins over the file: its options are read on top of the file's (a repeatable
option given on the command line replaces the file's list). A flag the file sets true
stays on: the command line has no way to say "off" for it.

Each run writes the options it ran with as `config.toml` beside its results, paths made
absolute and one-off options (resuming, with --accept-lr-change and a checkpoint folder only
resumed from; halting; a cluster's process) left out: `--config` of that file repeats the
run from its first step, from any folder.
"""
from __future__ import annotations

import argparse
import json
import re
import tomllib
from pathlib import Path

from jaxscale.files import write_text_atomically

NAME = "config.toml"
SKIP = ("help", "config")  # not settings of the run
ONE_OFF = ("baseline", "save-baseline", "save-params", "profile", "resume", "accept-lr-change",
           "halt-after", "process-id", "num-processes", "coordinator")  # not in config.toml


class ConfigError(ValueError):
    """A config file that cannot be read or holds a key or value the command refuses."""


def add_argument(p) -> None:
    p.add_argument("--config", default=None, metavar="FILE.toml",
                   help="read options from a TOML file: every option as a key (batch-size = "
                        "32, strategy = [\"dp=2\"]); the command line wins over the file. "
                        f"Each run writes the options it ran with as {NAME} beside its results")


def _actions(parser) -> dict[str, argparse.Action]:
    """The command's long options by key (the option without its dashes)."""
    out = {}
    for a in parser._actions:
        for o in a.option_strings:
            if o.startswith("--") and o[2:] not in SKIP:
                out[o[2:]] = a
    return out


def reparse(parser, argv: list[str], path: str) -> argparse.Namespace:
    """The command's options: the command line's where it gives them, else the file's, else
    the defaults. Which options the command line gives is read by parsing it with every
    default replaced by a marker, so that prefixes (--inj for --inject) count too."""
    values, given = load(path, parser), _given(parser, argv)
    parser.set_defaults(**{dest: v for dest, v in values.items() if dest not in given})
    args = parser.parse_args(argv)
    for a in parser._actions:  # a repeatable option on the line replaces the file's list
        if isinstance(a, argparse._AppendAction) and a.dest in given:
            setattr(args, a.dest, given[a.dest])
    return args


def _given(parser, argv: list[str]) -> dict:
    """{dest: value} of the options the command line itself sets."""
    marker, saved = object(), {a.dest: a.default for a in parser._actions}
    for a in parser._actions:
        a.default = None if isinstance(a, argparse._AppendAction) else marker
    try:
        parsed = vars(parser.parse_args(argv))
    finally:
        for a in parser._actions:
            a.default = saved[a.dest]
    return {d: v for d, v in parsed.items() if v is not marker and v is not None
            and d in saved}


def load(path: str, parser) -> dict:
    """{dest: value} of the file's keys, each checked as its option checks it."""
    try:
        text = Path(path).read_text(encoding="utf-8")  # TOML is UTF-8, as `write` writes it
        data = tomllib.loads(text)
    except OSError as e:
        raise ConfigError(f"cannot read the config {path!r}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"the config {path!r} is not UTF-8 text (byte {e.start}), as "
                          "TOML must be") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"the config {path!r} is not TOML: {e}") from None
    actions, values = _actions(parser), {}
    for key, value in data.items():
        where = f"{path} line {_line(text, key)}"
        a = actions.get(key) or actions.get(key.replace("_", "-"))
        if a is None:
            raise ConfigError(f"{where}: unknown key {key!r}; the keys are the options of "
                              f"`jaxscale {parser.prog.split()[-1]}`: "
                              f"{', '.join(sorted(actions))}")
        try:
            values[a.dest] = _convert(a, value)
        except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
            raise ConfigError(f"{where}: {key} = {json.dumps(value, default=str)}: {e}") \
                from None
    return values


def _convert(a: argparse.Action, value):
    if not isinstance(value, (str, int, float, bool, list)):  # a TOML date, time or table
        raise TypeError("takes a number, a string, true or false, or a list of them")
    if a.nargs == 0:  # a flag: true or false
        if not isinstance(value, bool):
            raise TypeError("a flag takes true or false")
        return a.const if value else a.default
    if isinstance(a, argparse._AppendAction):
        items = value if isinstance(value, list) else [value]
        return [_one(a, v) for v in items]
    if isinstance(value, (list, dict, bool)):
        raise TypeError("takes one value (a number or a string)")
    return _one(a, value)


def _one(a: argparse.Action, value):
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise TypeError("each item takes a number or a string")
    value = a.type(str(value)) if a.type else str(value)
    if a.choices is not None and value not in a.choices:
        raise ValueError(f"choose from {', '.join(map(str, a.choices))}")
    return value


def _line(text: str, key: str) -> int:
    for n, line in enumerate(text.splitlines(), 1):
        if re.match(rf"\s*{re.escape(key)}\s*=", line):
            return n
    return 1


def write(parser, args, folder, one_off: tuple[str, ...] = ()) -> Path:
    """`config.toml` in `folder`: every option this run ran with (None: left out), less
    ONE_OFF and the command's own `one_off` keys (options that served only this run)."""
    lines = [f"# jaxscale {parser.prog.split()[-1]}: the options of this run "
             f"(jaxscale {parser.prog.split()[-1]} --config {NAME} repeats it)"]
    for key, a in sorted(_actions(parser).items()):
        value = getattr(args, a.dest, None)
        if (value is None or value is False or key in ONE_OFF + one_off
                or a.dest in ("run", "argv")):
            continue
        lines.append(f"{key} = {_toml(value)}")
    path = Path(folder) / NAME
    Path(folder).mkdir(parents=True, exist_ok=True)
    write_text_atomically(path, "\n".join(lines) + "\n")
    return path


def _toml(value) -> str:
    if isinstance(value, Path):
        return _toml(str(value.resolve()))
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    # a JSON string is a TOML basic string, given the characters themselves (TOML has no
    # surrogate pairs) and its escapes for the control characters
    return json.dumps(str(value), ensure_ascii=False)
