"""fp8-delayed's amax history: training state that lives beside the parameters.

Every FP8 product keeps a history [3, H]: one row per operand (fp8.ROWS: activation,
weight, gradient), one column per step, the newest in column 0. The blocks' products are
named by their weights and stacked over the layers like them; the output head's exists
when the head is under the recipe (fp8_head):

    history = {"blocks": {"wq": [L, 3, H], "wk": ..., "w2": [L, 3, H]}, "head": [3, H]}

One step with it:

1. `attach` puts it into the parameters the model reads, each layer's share under the
   layer's own key (BLOCKS), so it follows the layer through every scan, pipeline chunk
   and ZeRO-3 unit with nothing else to change; the head's under HEAD.
2. Each product scales with the largest amax of its row (fp8.delayed_scale) and reports
   this step's three amaxes as the history's cotangent, in column 0 (fp8.delayed_einsum):
   a gradient's amax is known only in backward, and a cotangent is how a value computed
   there leaves autodiff.
3. The gradient function takes `newest` of that cotangent, its max over micro-batches
   (and pipeline ticks), and `pmax` over the devices that hold other rows or tokens: the
   amax of the whole step's tensor, the same on every device.
4. The step `roll`s it in: column 0 the new amaxes, the oldest column dropped. It does so
   whatever it decides about the update, as Transformer Engine does: a step dropped for
   a spike that saturated against too small a history brings the amax its retry needs.
   A non-finite amax is not rolled in (that product's history stays as it was): a NaN
   would hide every amax before it, an inf would scale the tensor to zero.

The history is replicated over dp, cp and tp (a product's amax is already a max over the
tp devices that split it, fp8.amax) and split over pp with the layers it belongs to.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.flatten_util import ravel_pytree

from jaxscale.model import fp8

HISTORY = 16  # the default length H (Transformer Engine's default is 1024; MaxText's 1024)
WEIGHTS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")  # a block's FP8 products, by weight
BLOCKS, HEAD = "fp8", "fp8_head"  # where `attach` puts the histories in the parameters


def init(params, length: int, head: bool) -> dict:
    """Zero histories (nothing seen yet: the first step scales from its own amaxes) for
    the products of `params` (whole, or one device's share of the layers)."""
    if length < 1:
        raise ValueError(f"the amax history needs at least one step, got {length}")
    blocks = params["blocks"]
    layers = blocks["wq"].shape[0]
    out = {"blocks": {n: jnp.zeros((layers, len(fp8.ROWS), length), jnp.float32)
                      for n in WEIGHTS if n in blocks}}
    if head:
        out["head"] = jnp.zeros((len(fp8.ROWS), length), jnp.float32)
    return out


def attach(params, history):
    """The parameters with each product's history beside its weight (see the top); the
    parameters unchanged without one."""
    if history is None:
        return params
    out = {**params, "blocks": {**params["blocks"], BLOCKS: history["blocks"]}}
    if "head" in history:
        out[HEAD] = history["head"]
    return out


def newest(reported):
    """The amaxes a backward pass reported (the history's cotangent: column 0)."""
    return jax.tree.map(lambda r: r[..., 0], reported)


def pmax(amaxes, axes: tuple[str, ...], after=None):
    """The max over `axes` of every amax, in one collective. XLA:CPU aborts when two
    all-reduces are in flight at once on a device (fp8's module docstring), and a max
    cannot join a sum's all-reduce: `after` (a scalar, e.g. the step's reduced loss) makes
    it wait for that one (+ 0 x after: exact where after is finite, and a non-finite one
    makes the amaxes non-finite, which `roll` leaves out)."""
    if not axes:
        return amaxes
    flat, unravel = ravel_pytree(amaxes)
    if after is not None:
        flat = flat + 0 * after
    return unravel(lax.pmax(flat, axes))


def settled(loss, grads) -> jax.Array:
    """A scalar computed from the step's reduced loss and the token table's reduced
    gradient (every layout has one, and replicates it over tp): `pmax`'s `after`."""
    return loss + jnp.ravel(grads["tok_embed"])[0].astype(jnp.float32)


def roll(history, amaxes):
    """The history one step on: `amaxes` in column 0, the oldest column dropped; a
    product whose amax is not finite keeps its history as it was."""
    def one(h, a):
        rolled = jnp.concatenate([a[..., None], h[..., :-1]], axis=-1)
        return jnp.where(jnp.isfinite(a)[..., None], rolled, h)
    return jax.tree.map(one, history, amaxes)


def nbytes(n_layers: int, products: int, length: int, head: bool) -> int:
    """The histories' bytes, closed form: for each product (`products` a layer, and the
    head's), three fp32 amaxes a step for `length` steps: per tensor, not per parameter,
    so small next to the weights."""
    return (n_layers * products + int(head)) * len(fp8.ROWS) * length * 4
