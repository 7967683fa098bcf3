"""Wall time: of a step (median and quartiles over repeats) and of a compile (and whether the
persistent compilation cache supplied the program)."""
from __future__ import annotations

import time

import jax
import numpy as np


def step_seconds(fn, *args, repeats: int = 10, warmup: int = 2) -> dict[str, float]:
    """Median and spread (quartiles, min, max) of fn(*args) wall time, after warm-up calls.

    Waits for fn's WHOLE result each time: return all of a step's outputs, not only its
    loss, or the timing stops early and the next call overlaps the previous one's tail. It
    also keeps dispatch from running ahead (an XLA CPU device admits 32 computations in
    flight)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    q1, median, q3 = (float(q) for q in np.quantile(times, [0.25, 0.5, 0.75]))
    return {"median_s": median, "q1_s": q1, "q3_s": q3, "min_s": min(times),
            "max_s": max(times), "repeats": repeats}


def compile_timed(lowered) -> tuple[object, float, str]:
    """(compiled, seconds, source): source is "cache" when the persistent compilation
    cache supplied the executable, "compiled" when XLA compiled it now."""
    hits = []
    listener = lambda event, **kw: hits.append(event)  # noqa: E731
    jax.monitoring.register_event_listener(listener)
    try:
        t0 = time.perf_counter()
        compiled = lowered.compile()
        seconds = time.perf_counter() - t0
    finally:
        jax.monitoring.unregister_event_listener(listener)
    source = "cache" if "/jax/compilation_cache/cache_hits" in hits else "compiled"
    return compiled, seconds, source


def compile_seconds(jitted, *args):
    """(compiled program, seconds to lower and compile it) for a jax.jit function."""
    t0 = time.perf_counter()
    compiled = jitted.lower(*args).compile()
    return compiled, time.perf_counter() - t0
