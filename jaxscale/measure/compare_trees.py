"""How far apart two trees of arrays are (gradients, parameters): the largest relative
difference over their tensors, each against its own scale.

Computed in NumPy on the host: the trees are small next to what a check costs, and an
eager jax.numpy op on a sharded array compiles its own little program for every shape and
sharding it meets (on 8 CPU devices about 0.1 s cold each, three per tensor), while the
same float32 subtraction, absolute value and maximum in NumPy give the same numbers."""
from __future__ import annotations

import jax
import numpy as np


def max_rel_diff(a, b, floor: float = 1e-4) -> float:
    """max over tensors of max|a - b| / max|b|, each tensor against its own scale, but never
    against less than `floor` x the largest tensor's scale.

    The floor exists for tensors whose exact value is 0, e.g. the key bias's gradient
    (adding a constant to every key shifts a query's scores alike, which softmax ignores):
    in floats they are rounding noise (~1e-11), and their own scale would turn that noise
    into a large relative error.
    """
    xs = [np.asarray(x) for x in jax.tree.leaves(a)]
    ys = [np.asarray(y) for y in jax.tree.leaves(b)]
    if len(xs) != len(ys):
        raise ValueError(f"the trees hold {len(xs)} and {len(ys)} tensors")
    largest = max(float(np.max(np.abs(y))) for y in ys)
    return max(float(np.max(np.abs(x - y))) / max(float(np.max(np.abs(y))), floor * largest)
               for x, y in zip(xs, ys))
