"""How far apart two trees of arrays are (gradients, parameters): the largest relative
difference over their tensors, each against its own scale."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def max_rel_diff(a, b, floor: float = 1e-4) -> float:
    """max over tensors of max|a - b| / max|b|, each tensor against its own scale, but never
    against less than `floor` x the largest tensor's scale.

    The floor exists for tensors whose exact value is 0, e.g. the key bias's gradient
    (adding a constant to every key shifts a query's scores alike, which softmax ignores):
    in floats they are rounding noise (~1e-11), and their own scale would turn that noise
    into a large relative error.
    """
    largest = max(float(jnp.max(jnp.abs(y))) for y in jax.tree.leaves(b))
    return max(float(jnp.max(jnp.abs(x - y))) / max(float(jnp.max(jnp.abs(y))), floor * largest)
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
