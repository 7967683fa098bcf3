"""Sizes in and out: counts and byte sizes as people write them, bytes as the project prints them.

Counts take k, M, B (or G) and T as 1e3, 1e6, 1e9, 1e12: "7B", "350M", "7e9". Sizes take
decimal and binary units: GB = 1e9 and GiB = 2^30 bytes ("80GB", "80GiB", "8e10"). A size
that is not a finite number > 0, or is beyond any real model or device, is refused with a
CostModelError that names the bad text and an example of what is understood.
"""
from __future__ import annotations

from jaxscale.costmodel import CostModelError

_COUNT = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_BYTES = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


# The largest count (parameters) and size accepted: far beyond any model or device, yet small
# enough that every figure derived from them stays a readable, finite float.
MAX_COUNT, MAX_BYTES = 1e15, 1e18


def _parse(text: str, scale: dict, what: str, examples: str, maximum: float) -> float:
    s = str(text).strip().replace("_", "").replace(",", "")
    if s.lower().lstrip("+-") in ("nan", "inf", "infinity"):
        raise CostModelError(f"{what} {text!r} is not understood: it must be a finite number "
                             f"> 0; write e.g. {examples}")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    unit = s[len(num):].strip().lower()
    try:
        value = float(num) * scale[unit]
    except (ValueError, KeyError):
        raise CostModelError(f"{what} {text!r} is not understood; write e.g. {examples}") from None
    if not (value > 0 and value != float("inf")):
        raise CostModelError(f"{what} must be > 0, got {text!r}")
    if value > maximum:
        limit = f"{maximum:.0e}".replace("e+", "e")
        raise CostModelError(f"{what} must be at most {limit}, got {text!r}")
    return value


def parse_count(text: str) -> float:
    """A positive count such as "7e9", "7B" (billion), "350M", "1.5T", "7000000000"."""
    return _parse(text, _COUNT, "count", "7e9, 7B, 350M or 1.5T", MAX_COUNT)


def parse_bytes(text: str) -> float:
    """A positive size in bytes: "80GB" (1e9), "80GiB" (2^30), "512MB", or plain "8e10"."""
    return _parse(text, _BYTES, "size", "80GB, 80GiB, 512MB or 8e10", MAX_BYTES)


def human_bytes(n: float) -> str:
    """Bytes with both units the project uses: GB = 1e9 and GiB = 2^30 (or MB / MiB, and
    PB / PiB from 1e15 on, where GB would need too many digits)."""
    if abs(n) >= 1e15:
        return f"{n / 1e15:,.4g} PB ({n / 2**50:,.4g} PiB)"
    if abs(n) >= 1e9:
        return f"{n / 1e9:,.2f} GB ({n / 2**30:,.2f} GiB)"
    return f"{n / 1e6:,.1f} MB ({n / 2**20:,.1f} MiB)"


def short_bytes(n: float) -> str:
    """One unit only, for tables too narrow for both: MB (1e6), GB (1e9) or PB (1e15)."""
    if abs(n) >= 1e15:
        return f"{n / 1e15:,.4g} PB"
    return f"{n / 1e9:,.2f} GB" if abs(n) >= 1e9 else f"{n / 1e6:,.1f} MB"
