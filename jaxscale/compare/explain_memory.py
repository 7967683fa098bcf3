"""What fills a layout's memory during its step: `jaxscale explain`'s second half.

The state's tensors (jaxscale.compare.explain) persist between steps; inside the step
there is more. Two views of it, each from the program itself:

  saved activations   what backward keeps of each layer, from jax's trace of one block on
                      one device (jaxscale.measure.residuals): per layer, and the total a
                      device holds (its layers x the micro-batches in flight)
  peak buffers        the compiled step's values live together at the peak of XLA's
                      temporary heap, largest first, each named by the HLO instruction that
                      makes it and jax's op_name (jaxscale.measure.buffers; XLA:TPU keeps
                      the assignment back, so there from its text dump,
                      jaxscale.measure.buffer_dump), beside XLA's memory analysis

The step is compiled, never run, on the devices given: forced host devices, or a target's
compile-only chips, where XLA:TPU or XLA:GPU does the placing (and may refuse a program
too big for the chip: then its own sentence is the answer).
"""
from __future__ import annotations

import jax

from jaxscale.compare.abstract import abstract_batch
from jaxscale.measure import buffer_dump, buffers, memory, residuals

TOP = 12  # peak buffers listed


def inside_step(cfg, plan, step, state, devices, batch_size: int, top: int = TOP) -> dict:
    """The saved activations and the compiled step's peak buffers (module docstring), for
    one batch of `batch_size` rows of cfg.seq_len tokens; `step, state` from
    jaxscale.compare.explain.build."""
    out = {"batch_size": batch_size, "seq": cfg.seq_len,
           "activations": residuals.block_residuals(cfg, plan, batch_size)}
    batch = abstract_batch(step, devices, batch_size, cfg.seq_len)
    try:
        compiled, rows = _compiled_and_peak(step, state, batch, devices)
    except jax.errors.JaxRuntimeError as e:
        out["refused"] = memory.refusal(e)
        if out["refused"] is None:
            raise
        return out
    out["memory"] = memory.memory(compiled)
    out["at_peak"] = buffers.by_kind(rows)
    out["peak_buffers"] = [r for r in rows if r["kind"] == "temporary"][:top]
    return out


def _compiled_and_peak(step, state, batch, devices) -> tuple:
    """(the compiled step, the buffers live at its peak). XLA:TPU keeps its buffer
    assignment back, so on TPU devices the step is compiled once with the text dump on and
    read from it; elsewhere from the program, or from a dump if a compiler returns none."""
    if devices[0].platform == "tpu":
        return buffer_dump.compile_and_read(step.jitted, state, batch)
    compiled = step.jitted.lower(state, batch).compile()
    rows = (buffers.peak_buffers(compiled)
            or buffer_dump.compile_and_read(step.jitted, state, batch)[1])
    return compiled, rows
