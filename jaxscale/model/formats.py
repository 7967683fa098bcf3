"""Number formats, computed for real: every figure of `format_table()` is read from
ml_dtypes.finfo, and `classify` says what happens to values stored in a smaller format:
normal, subnormal (gradual underflow, fewer significant bits), flushed to zero, or overflow
to inf.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np


FORMATS = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
           "float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}


class PrecisionError(ValueError):
    """An unknown format or policy, or an inconsistent policy."""


def dtype_of(name_or_dtype) -> np.dtype:
    """The numpy dtype of a format's name (or of a dtype)."""
    if isinstance(name_or_dtype, str):
        if name_or_dtype not in FORMATS:
            raise PrecisionError(f"unknown format {name_or_dtype!r}; choose from {', '.join(FORMATS)}")
        return np.dtype(FORMATS[name_or_dtype])
    return np.dtype(name_or_dtype)


def format_table() -> list[dict]:
    """Bits, exponent/mantissa bits, range and precision of each format, from ml_dtypes.finfo."""
    rows = []
    for name, dt in FORMATS.items():
        fi = ml_dtypes.finfo(dt)
        rows.append({"format": name, "bits": fi.bits, "exponent_bits": fi.nexp,
                     "mantissa_bits": fi.nmant, "max": float(fi.max),
                     "smallest_normal": float(fi.smallest_normal),
                     "smallest_subnormal": float(fi.smallest_subnormal), "eps": float(fi.eps),
                     "decimal_digits": fi.precision})
    return rows


def round_to(x, fmt) -> np.ndarray:
    """x rounded to `fmt` (round to nearest even) and returned as float32: the value stored."""
    with np.errstate(over="ignore"):  # overflow to inf is the point, not an accident
        return np.asarray(np.asarray(x, np.float32).astype(dtype_of(fmt)), np.float32)


CATEGORIES = ("zero", "normal", "subnormal", "flushed", "overflow")


def classify(x, fmt) -> dict[str, float]:
    """Fractions of x that, stored in `fmt`, are zero already, normal, subnormal, flushed to
    zero (nonzero but rounds to 0) or overflow (finite but rounds to +-inf)."""
    x = np.asarray(x, np.float32).ravel()
    r = round_to(x, fmt)
    tiny = float(ml_dtypes.finfo(dtype_of(fmt)).smallest_normal)
    zero = x == 0
    flushed = ~zero & (r == 0)
    overflow = np.isfinite(x) & ~np.isfinite(r)
    subnormal = (r != 0) & (np.abs(r) < tiny)
    normal = ~zero & ~flushed & ~overflow & ~subnormal
    n = max(x.size, 1)
    return {k: float(v.sum()) / n for k, v in zip(CATEGORIES, (zero, normal, subnormal, flushed,
                                                                overflow))}
