"""Optimizer states in a lower precision: Adam's moments in bf16 beside fp32 master weights.

Adam keeps two moments per parameter; in fp32 they are 8 of mixed precision's 16 bytes per
parameter (2 working weights + 2 gradients + 4 master + 8 moments). Kept in bfloat16 they
take 4 (MaxText's `mu_dtype`, torchtitan's bf16 optimizer states, Megatron's
precision-aware optimizer). `states_in` wraps any optimizer: each update reads its state
as fp32, runs the optimizer's own equations unchanged, and rounds the new state to the
dtype (round to nearest even); integer state (the step count) is left alone. What is lost
is what bf16 cannot hold: an 8-bit significand, so a moment's update smaller than 1/256
of it rounds away. The second moment with b2 = 0.95 (the adamw jaxscale trains with)
moves by 5% a step and survives; with Adam's default b2 = 0.999 it moves by 0.1% and
freezes (after a spike it never decays), so those are refused (`check_state_dtype`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

STATE_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


def _cast(tree, dtype):
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating)
                        else x, tree)


def states_in(name: str, inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """`inner` with its floating-point state kept in STATE_DTYPES[name] (module docstring);
    fp32 returns `inner` itself."""
    if name not in STATE_DTYPES:
        raise ValueError(f"unknown optimizer state dtype {name!r}; choose from "
                         f"{', '.join(STATE_DTYPES)}")
    if name == "fp32":
        return inner
    dtype = STATE_DTYPES[name]

    def init(params):
        return _cast(inner.init(params), dtype)

    def update(grads, state, params=None):
        updates, new = inner.update(grads, _cast(state, jnp.float32), params)
        return updates, _cast(new, dtype)
    return optax.GradientTransformation(init, update)


# optimizers whose state moves each step by less than bf16 can hold (2^-8 of itself): in
# bf16 it would stop following the gradients (a second moment after a spike never decays)
TOO_SLOW_FOR_BF16 = {"adam": "its second moment moves by 1 - b2 = 0.001 a step",
                     "adam_l2": "its second moment moves by 1 - b2 = 0.001 a step",
                     "adagrad": "its running sum of squares only grows, by ever smaller shares"}


def check_state_dtype(optimizer: str, name: str) -> None:
    """ValueError if `optimizer`'s state cannot be kept in STATE_DTYPES[name]."""
    if name == "bf16" and optimizer in TOO_SLOW_FOR_BF16:
        raise ValueError(f"--optimizer-state-dtype bf16 with {optimizer}: "
                         f"{TOO_SLOW_FOR_BF16[optimizer]}, below bf16's resolution (2^-8 = "
                         "0.0039 of itself), so it would stop following the gradients; use "
                         "adamw (b2 0.95 here), momentum or rmsprop, or fp32 states")


def moment_bytes(name: str) -> int:
    """Bytes of one moment entry in STATE_DTYPES[name]."""
    return jnp.dtype(STATE_DTYPES[name]).itemsize
