"""What FP8 does to each tensor it casts: counted inside the program, reported to the host.

A product under an FP8 recipe (jaxscale.model.fp8) casts three tensors: the activation and
the weight in forward, the incoming gradient in backward. Each value lands in one of:

  overflow   |x s| rounds beyond the format's largest value: saturated (the recipes clip;
             a plain cast gives NaN in E4M3, which has no inf). Current scaling sets s from this tensor's own amax, so it cannot overflow;
             a scale from earlier steps (delayed scaling) or none at all can.
  flushed    x != 0 but x s rounds to 0: the value is gone
  subnormal  below the format's smallest normal value: kept, with fewer significant bits
             (the scale no longer buys full precision: the value "lost its scale")
  and, for contrast, what a plain cast without any scale would do: `unscaled_flushed` and
  `unscaled_overflow` (bf16 gradients of 1e-6 are far below E4M3's smallest step, 2^-9).

`watching(report)` is a context manager: a program traced inside it carries, at each cast,
a few reductions and one `jax.debug.callback` that calls report(kind, counts) on the host
with kind in KINDS and counts a dict of COUNTS (numbers of elements). Only programs traced
inside the context are watched: a program compiled before it, or after, is unchanged.
"""
from __future__ import annotations

import contextlib
import contextvars
from functools import partial

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

KINDS = ("activations", "weights", "gradients")
COUNTS = ("elements", "nonzero", "overflow", "flushed", "subnormal", "unscaled_flushed",
          "unscaled_overflow")
_REPORT: contextvars.ContextVar = contextvars.ContextVar("fp8_report", default=None)


@contextlib.contextmanager
def watching(report):
    """Within: every FP8 cast traced reports report(kind, {count: n}) each time it runs."""
    token = _REPORT.set(report)
    try:
        yield
    finally:
        _REPORT.reset(token)


def observe(kind: str, x, scaled, q, fmt) -> None:
    """Report the cast of `x` (scaled: x times its scale, fp32; q: the FP8 values) if a
    program is being traced inside `watching`; nothing otherwise."""
    report = _REPORT.get()
    if report is None:
        return
    jax.debug.callback(partial(_deliver, report, kind), tally(x, scaled, q, fmt))


def tally(x, scaled, q, fmt) -> jax.Array:
    """The COUNTS of one cast as a float32 vector (fp32 counts are exact up to 2^24)."""
    info = ml_dtypes.finfo(fmt)
    largest, normal = float(info.max), float(info.smallest_normal)
    half_step = float(info.smallest_subnormal) / 2  # at most this, a value rounds to 0
    # beyond the largest value's half step a value rounds past it (x s may exceed the
    # largest by an fp32 rounding of 448 / amax: that still rounds to it, no overflow)
    beyond = largest + 2.0 ** (np.floor(np.log2(largest)) - info.nmant) / 2
    x32, qf = x.astype(jnp.float32), q.astype(jnp.float32).reshape(x.shape)
    a, s = jnp.abs(x32), jnp.abs(scaled.reshape(x.shape))
    nonzero = x32 != 0
    counts = (jnp.ones_like(a), nonzero, s >= beyond, nonzero & (qf == 0),
              (qf != 0) & (jnp.abs(qf) < normal), nonzero & (a <= half_step), a >= beyond)
    return jnp.stack([jnp.sum(c.astype(jnp.float32)) for c in counts])


def _deliver(report, kind, counts) -> None:
    report(kind, dict(zip(COUNTS, np.asarray(counts, np.float64).tolist())))


class Tally:
    """A report function that sums what it is told per kind, and hands out fractions."""

    def __init__(self):
        self.reset()

    def __call__(self, kind: str, counts: dict) -> None:
        mine = self.sums.setdefault(kind, dict.fromkeys(COUNTS, 0.0))
        for k, v in counts.items():
            mine[k] += v

    def reset(self) -> None:
        self.sums: dict[str, dict] = {}

    def fractions(self) -> dict[str, dict[str, float]]:
        """Per kind: each count as a fraction of the nonzero elements (of all of them for
        `nonzero` itself)."""
        out = {}
        for kind, c in self.sums.items():
            nz = max(c["nonzero"], 1.0)
            out[kind] = {k: c[k] / nz for k in COUNTS[2:]}
            out[kind]["nonzero"] = c["nonzero"] / max(c["elements"], 1.0)
        return out
