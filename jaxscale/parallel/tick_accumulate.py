"""What a pipeline's ticks accumulate from their backward passes (jaxscale.parallel.pipeline):
the weight gradients, summed, and under fp8-delayed beside them the amaxes its products
report (jaxscale.model.fp8_history), a max: a micro-batch's amax is not added to the next
one's. The head's amaxes count only from the tick whose chunk feeds the loss, and the
step's are the same on every device once reduced over dp, then (the head's) over pp.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxscale.model import fp8_history
from jaxscale.runtime.vma import vary, zeros_like


class Accumulate:
    """What the ticks accumulate from their backward passes: the gradients (summed), and
    under fp8-delayed beside them the amaxes the `history` reports (a max). Each device
    differentiates its own copy of the history (varying over `axes`, dp and pp), as of
    the parameters: no implicit collective inside lax.switch."""

    def __init__(self, history, axes):
        self.axes = axes
        self.seen = (None if history is None
                     else jax.tree.map(lambda h: vary(h, axes), history))

    def zeros(self, grads):
        zeros = jax.tree.map(zeros_like, grads)
        if self.seen is None:
            return zeros
        return zeros, fp8_history.newest(jax.tree.map(zeros_like, self.seen))

    def add(self, acc, new):
        if self.seen is None:
            return jax.tree.map(jnp.add, acc, new)
        return jax.tree.map(jnp.add, acc[0], new[0]), jax.tree.map(jnp.maximum, acc[1], new[1])

    def parts(self, acc):
        """(gradients, amaxes or None)."""
        return (acc, None) if self.seen is None else acc

    def model(self, stage_fn, prm, x, mb, chunk, hist=None):
        """stage_fn on `prm` with the histories attached (`hist`, default `seen`)."""
        hist = self.seen if hist is None else hist
        return stage_fn(fp8_history.attach(prm, hist), x, mb, chunk)

    def vjp(self, stage_fn, mine, x, mb, chunk):
        """(loss, pull(dy, d_loss) -> (d_params, or (d_params, amaxes), dx))."""
        if self.seen is None:
            (_, loss), pull = jax.vjp(lambda prm, h: stage_fn(prm, h, mb, chunk), mine, x)
            return loss, lambda *cts: pull(cts)
        (_, loss), pull = jax.vjp(lambda prm, hist, h: self.model(stage_fn, prm, h, mb,
                                                                   chunk, hist),
                                  mine, self.seen, x)

        def both(*cts):
            d_params, reported, dx = pull(cts)
            return (d_params, fp8_history.newest(reported)), dx
        return loss, both

    def own_head(self, d_params, last):
        """A tick's amaxes with the head's kept only where its chunk feeds the loss (`last`):
        every chunk computes the head and masks it, so elsewhere it saw no real input."""
        if self.seen is None or "head" not in d_params[1]:
            return d_params
        grads, amaxes = d_params
        return grads, {**amaxes, "head": jnp.where(last, amaxes["head"], 0.0)}

    def outputs(self, loss, grads, amaxes):
        """The grad_fn's: (loss, grads), and the step's amaxes third under fp8-delayed,
        reduced after the loss and gradients (fp8_history.settled)."""
        if amaxes is None:
            return loss, grads
        return loss, grads, self.reduce(amaxes, fp8_history.settled(loss, grads))

    def reduce(self, amaxes, after=None):
        """The step's amaxes, the same on every device: everything over dp (its replicas
        ran other rows), then the head's over pp (only the loss's device saw it). The
        second collective takes the first's result, so they never run at once: see
        fp8_history.pmax."""
        dp_axis, pp_axis = self.axes
        amaxes = fp8_history.pmax(amaxes, (dp_axis,), after)
        if "head" in amaxes:
            amaxes = {**amaxes, "head": lax.pmax(amaxes["head"], pp_axis)}
        return amaxes


def per_micro(reduction, d_params, acc: Accumulate):
    """A backward tick's gradients as the layout reduces them (the amaxes beside as they are)."""
    if acc.seen is None:
        return reduction.per_micro(d_params)
    return reduction.per_micro(d_params[0]), d_params[1]
