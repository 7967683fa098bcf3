"""`--model`: a preset's name or a Hugging Face config.json, checked when parsed.

One argparse type for every subcommand that takes a model, so that a misspelt preset and
a config.json with a field jaxscale does not know fail alike: one line naming the value
and the choices, exit 2, before anything is built. A config.json is kept as an absolute
path, so that a checkpoint's record and compare's workers find it from anywhere.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from jaxscale.model import config as model_config


def model_arg(text: str) -> str:
    """argparse type: a preset name, or the absolute path of a readable config.json."""
    name = str(Path(text).expanduser().resolve()) if model_config.is_file(text) else text
    try:
        model_config.preset(name)
    except model_config.ModelConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return name


FILE_HELP = ("or PATH/config.json: a Hugging Face LlamaConfig or GPT2Config, read offline "
             "(every field accounted for)")
