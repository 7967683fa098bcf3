"""What FP8 does to each tensor it casts: counted inside the program, reported to the host.

A product under an FP8 recipe (jaxscale.model.fp8) casts three tensors: the activation and
the weight in forward, the incoming gradient in backward. Each value lands in one of:

  overflow   x s rounds past the format's largest value (to NaN in E4M3, which has no
             inf; to inf in E5M2): the recipes clip it to the largest instead. Current
             scaling takes s from this tensor's own amax, so it cannot overflow; a scale
             from earlier steps (delayed scaling) or none at all can.
  flushed    x != 0 but x s rounds to 0: the value is gone
  subnormal  below the format's smallest normal value: kept, with fewer significant bits
             (the scale no longer buys full precision: the value "lost its scale")
  and, for contrast, what a plain cast without any scale would do: `unscaled_flushed` and
  `unscaled_overflow` (bf16 gradients of 1e-6 are far below E4M3's smallest step, 2^-9).

`watching(report)` is a context manager. Whether a program is watched is decided when JAX
traces it: one traced inside carries, at each cast, a few reductions and one
`jax.debug.callback` that calls report(kind, counts) on the host (kind in KINDS, counts a
dict of COUNTS), and keeps reporting whenever it runs, inside the context or not; one traced
before reports nothing, even when called inside (JAX caches a function's trace by the
function, not by this context). So build the step inside the context, or trace it there
first (experiments.fp8 lowers and compiles it there).

The counts are per execution and per device: a cast that runs twice (recomputed in
backward under remat, a weight cast again for each accumulated micro-batch) reports twice,
and each device reports its own piece. Repeats are identical, so the fractions
(`Tally.fractions`) are what to read; the absolute sums say how much ran.
"""
from __future__ import annotations

import contextlib
import contextvars
import threading
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
    """The COUNTS of one cast as an int32 vector. Overflow is what the cast makes of x s,
    rounding ties included (464 rounds to 448 in E4M3, 61440 to inf in E5M2): `_past`."""
    info = ml_dtypes.finfo(fmt)
    x32, qf = x.astype(jnp.float32), q.astype(jnp.float32).reshape(x.shape)
    past = _past(fmt)
    nonzero = x32 != 0
    half_step = float(info.smallest_subnormal) / 2  # at most this, a plain cast gives 0
    counts = (jnp.ones_like(x32, bool), nonzero, past(scaled.reshape(x.shape)),
              nonzero & (qf == 0), (qf != 0) & (jnp.abs(qf) < float(info.smallest_normal)),
              nonzero & (jnp.abs(x32) <= half_step), past(x32))
    return jnp.stack([jnp.sum(c, dtype=jnp.int32) for c in counts])


def _past(fmt):
    """v -> whether casting v to fmt rounds past its largest value: beyond the half step
    above it, or onto that half step when round-to-nearest-even goes up there (the
    largest value's last mantissa bit is 1: E5M2's 1.11 x 2^15, not E4M3's 1.110 x 2^8).
    Comparisons only (the program runs them at every cast, every step)."""
    info = ml_dtypes.finfo(fmt)
    largest = float(info.max)
    exponent = np.floor(np.log2(largest))
    tie = largest + 2.0 ** (exponent - info.nmant) / 2
    odd = int(round((largest / 2.0 ** exponent - 1) * 2 ** info.nmant)) % 2 == 1
    return lambda v: ~jnp.isfinite(v) | ((jnp.abs(v) >= tie) if odd else (jnp.abs(v) > tie))


def _deliver(report, kind, counts) -> None:
    report(kind, dict(zip(COUNTS, np.asarray(counts, np.int64).tolist())))


class Tally:
    """A report function that sums what it is told per kind, and hands out fractions.
    Callbacks may come from several runtime threads at once (one per device): a lock
    keeps every sum whole."""

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def __call__(self, kind: str, counts: dict) -> None:
        with self._lock:
            mine = self.sums.setdefault(kind, dict.fromkeys(COUNTS, 0))
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
