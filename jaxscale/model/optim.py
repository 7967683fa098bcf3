"""Optimizers written from their update equations, as optax GradientTransformations.

Each one is bit-identical to its optax twin (max abs diff 0.0 after hundreds of steps):
floating-point addition is not associative, so `b*m + (1-b)*g` and `(1-b)*g + b*m`, or
`1/sqrt(x)` and `rsqrt(x)`, round differently, and training amplifies a last-bit
difference until whole runs diverge. So every expression below is written in the order
optax evaluates it; the comments name the places where the order matters.

Notation: g = gradient, p = parameter, t = step (1 for the first update), eta_t = the
learning rate (a float, or an optax schedule evaluated at t-1), u = the returned update,
which `optax.apply_updates` adds to p.
"""
from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

ScalarOrSchedule = float | jax.Array | Callable[[jax.Array], jax.Array]


class OptimizerError(ValueError):
    """An optimizer hyperparameter is out of range."""


class SgdState(NamedTuple):
    count: jax.Array  # updates applied so far (int32); drives a schedule


class MomentumState(NamedTuple):
    count: jax.Array
    trace: Any  # velocity, one array per parameter


class AdagradState(NamedTuple):
    count: jax.Array
    sum_of_squares: Any


class RmsPropState(NamedTuple):
    count: jax.Array
    nu: Any  # moving average of g^2


class AdamState(NamedTuple):
    count: jax.Array
    mu: Any  # first moment, moving average of g
    nu: Any  # second moment, moving average of g^2


def _zero_count() -> jax.Array:
    return jnp.zeros([], jnp.int32)


def _scale_by_lr(learning_rate: ScalarOrSchedule, count: jax.Array, updates):
    """u <- -eta_t * u; a schedule is evaluated at the number of updates done so far."""
    if callable(learning_rate):
        step = -1 * learning_rate(count)
        return jax.tree.map(lambda u: jnp.array(step, dtype=u.dtype) * u, updates)
    step = -1 * learning_rate
    return jax.tree.map(lambda u: step * u, updates)


def _check(name: str, value, low: float, high: float | None = None, *, open_low=False) -> None:
    if isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer) and value.ndim == 0:
        value = float(value)
    if not isinstance(value, (int, float)):
        return  # traced or array hyperparameters are the caller's responsibility
    bad = value < low or (open_low and value == low) or (high is not None and value >= high)
    if bad or math.isnan(value):
        rng = f"{'(' if open_low else '['}{low}, {high if high is not None else 'inf'})"
        raise OptimizerError(f"{name} must be in {rng}, got {value}")


def sgd(learning_rate: ScalarOrSchedule) -> optax.GradientTransformation:
    """Plain stochastic gradient descent: u = -eta_t * g."""

    def init(params):
        del params
        return SgdState(count=_zero_count())

    def update(grads, state, params=None):
        del params
        return _scale_by_lr(learning_rate, state.count, grads), SgdState(
            optax.safe_increment(state.count))

    return optax.GradientTransformation(init, update)


def momentum(learning_rate: ScalarOrSchedule, beta: float = 0.9,
             nesterov: bool = False) -> optax.GradientTransformation:
    """Heavy-ball momentum: v_t = g + beta*v_{t-1}; u = -eta_t * v_t.

    Nesterov: u = -eta_t * (g + beta*v_t), a look-ahead along the new velocity.
    (optax.sgd(lr, momentum=beta, nesterov=...) is the twin.)
    """
    _check("beta", beta, 0.0, 1.0)

    def init(params):
        return MomentumState(_zero_count(), jax.tree.map(jnp.zeros_like, params))

    def update(grads, state, params=None):
        del params
        trace = jax.tree.map(lambda g, v: g + beta * v, grads, state.trace)
        direction = jax.tree.map(lambda g, v: g + beta * v, grads, trace) if nesterov else trace
        updates = _scale_by_lr(learning_rate, state.count, direction)
        return updates, MomentumState(optax.safe_increment(state.count), trace)

    return optax.GradientTransformation(init, update)


def adagrad(learning_rate: ScalarOrSchedule, initial_accumulator_value: float = 0.1,
            eps: float = 1e-7) -> optax.GradientTransformation:
    """AdaGrad: G_t = G_{t-1} + g^2 (G_0 = initial_accumulator_value); u = -eta_t * g / sqrt(G_t + eps).

    Every parameter gets its own step size, which only ever shrinks: frequent, large
    gradients slow down; rare ones (e.g. rare-word embeddings) keep a large step.
    """
    _check("initial_accumulator_value", initial_accumulator_value, 0.0)
    _check("eps", eps, 0.0)

    def init(params):
        return AdagradState(_zero_count(), jax.tree.map(
            lambda p: jnp.full_like(p, initial_accumulator_value), params))

    def update(grads, state, params=None):
        del params
        sum_sq = jax.tree.map(lambda g, s: g * g + s, grads, state.sum_of_squares)
        # rsqrt, not 1/sqrt: a different rounding; where() guards an all-zero accumulator
        inv = jax.tree.map(lambda s: jnp.where(s > 0, jax.lax.rsqrt(s + eps), 0.0), sum_sq)
        direction = jax.tree.map(lambda i, g: i * g, inv, grads)
        updates = _scale_by_lr(learning_rate, state.count, direction)
        return updates, AdagradState(optax.safe_increment(state.count), sum_sq)

    return optax.GradientTransformation(init, update)


def rmsprop(learning_rate: ScalarOrSchedule, decay: float = 0.9,
            eps: float = 1e-8) -> optax.GradientTransformation:
    """RMSProp: nu_t = (1-decay)*g^2 + decay*nu_{t-1}; u = -eta_t * g / sqrt(nu_t + eps).

    AdaGrad with a forgetting memory, so the step size no longer decays to zero.
    (eps sits inside the square root, as in optax.)
    """
    _check("decay", decay, 0.0, 1.0)
    _check("eps", eps, 0.0)

    def init(params):
        return RmsPropState(_zero_count(), jax.tree.map(jnp.zeros_like, params))

    def update(grads, state, params=None):
        del params
        nu = jax.tree.map(lambda g, n: (1 - decay) * g**2 + decay * n, grads, state.nu)
        direction = jax.tree.map(lambda n, g: jax.lax.rsqrt(n + eps) * g, nu, grads)
        updates = _scale_by_lr(learning_rate, state.count, direction)
        return updates, RmsPropState(optax.safe_increment(state.count), nu)

    return optax.GradientTransformation(init, update)


def _adam_direction(grads, state: AdamState, b1, b2, eps, eps_root, bias_correction):
    """The Adam step before the learning rate: m_hat / (sqrt(v_hat + eps_root) + eps)."""
    # (1-b)*g + b*m, in this order: b*m + (1-b)*g rounds differently
    mu = jax.tree.map(lambda g, m: (1 - b1) * g + b1 * m, grads, state.mu)
    nu = jax.tree.map(lambda g, v: (1 - b2) * g**2 + b2 * v, grads, state.nu)
    count = optax.safe_increment(state.count)
    if bias_correction:
        c1, c2 = 1 - b1**count, 1 - b2**count  # computed in fp32, then divided in the moment's dtype
        mu_hat = jax.tree.map(lambda m: m / c1.astype(m.dtype), mu)
        nu_hat = jax.tree.map(lambda v: v / c2.astype(v.dtype), nu)
    else:
        mu_hat, nu_hat = mu, nu
    direction = jax.tree.map(lambda m, v: m / (jnp.sqrt(v + eps_root) + eps), mu_hat, nu_hat)
    return direction, AdamState(count, mu, nu)


def _check_adam(b1, b2, eps, eps_root) -> None:
    _check("b1", b1, 0.0, 1.0)
    _check("b2", b2, 0.0, 1.0)
    _check("eps", eps, 0.0)
    _check("eps_root", eps_root, 0.0)


def adam(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
         eps: float = 1e-8, eps_root: float = 0.0,
         bias_correction: bool = True) -> optax.GradientTransformation:
    """Adam: m_t = (1-b1)*g + b1*m_{t-1}; v_t = (1-b2)*g^2 + b2*v_{t-1};
    m_hat = m_t/(1-b1^t), v_hat = v_t/(1-b2^t); u = -eta_t * m_hat / (sqrt(v_hat + eps_root) + eps).

    With bias_correction=False, m_hat = m_t and v_hat = v_t: the early steps are then
    (1-b1^t)/sqrt(1-b2^t) times the set learning rate (3.16x at t=1 for b2=0.999).
    """
    _check_adam(b1, b2, eps, eps_root)

    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return AdamState(_zero_count(), zeros, jax.tree.map(jnp.zeros_like, params))

    def update(grads, state, params=None):
        del params
        direction, new = _adam_direction(grads, state, b1, b2, eps, eps_root, bias_correction)
        return _scale_by_lr(learning_rate, state.count, direction), new

    return optax.GradientTransformation(init, update)


def adamw(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
          eps: float = 1e-8, weight_decay: float = 1e-4, mask=None, eps_root: float = 0.0,
          ) -> optax.GradientTransformation:
    """AdamW, decoupled weight decay: u = -eta_t * (adam_direction + weight_decay * p).

    The decay bypasses Adam's 1/sqrt(v_hat) scaling, so every parameter shrinks by the same
    factor (1 - eta_t*weight_decay) per step whatever its gradient size. `mask` (a pytree of
    bools shaped like the params, or a function params -> such a pytree) limits the decay
    to the True leaves.
    """
    _check_adam(b1, b2, eps, eps_root)
    _check("weight_decay", weight_decay, 0.0)

    def init(params):
        return adam(learning_rate, b1, b2, eps, eps_root).init(params)

    def update(grads, state, params=None):
        if params is None:
            raise OptimizerError("adamw needs the parameters: call update(grads, state, params)")
        direction, new = _adam_direction(grads, state, b1, b2, eps, eps_root, True)
        decay_on = jax.tree.map(lambda _: True, params) if mask is None else (
            mask(params) if callable(mask) else mask)
        direction = jax.tree.map(lambda d, p, on: d + weight_decay * p if on else d,
                                 direction, params, decay_on)
        return _scale_by_lr(learning_rate, state.count, direction), new

    return optax.GradientTransformation(init, update)


def adam_l2(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
            eps: float = 1e-8, l2: float = 1e-4, eps_root: float = 0.0,
            ) -> optax.GradientTransformation:
    """Adam on an L2-regularised loss: g' = g + l2 * p goes through Adam's moments.

    Unlike AdamW the decay term is divided by sqrt(v_hat): parameters with large gradients
    are hardly decayed, those with small gradients very strongly.
    """
    _check_adam(b1, b2, eps, eps_root)
    _check("l2", l2, 0.0)
    inner = adam(learning_rate, b1, b2, eps, eps_root)

    def update(grads, state, params=None):
        if params is None:
            raise OptimizerError("adam_l2 needs the parameters: call update(grads, state, params)")
        grads = jax.tree.map(lambda g, p: g + l2 * p, grads, params)
        return inner.update(grads, state)

    return optax.GradientTransformation(inner.init, update)


def bias_correction_multiplier(t: int, b1: float = 0.9, b2: float = 0.999) -> float:
    """How much larger Adam's step t is without bias correction: (1 - b1^t) / sqrt(1 - b2^t)."""
    return (1 - b1**t) / math.sqrt(1 - b2**t)


OPTIMIZERS: dict[str, Callable[..., optax.GradientTransformation]] = {
    "sgd": sgd, "momentum": momentum,
    "nesterov": lambda lr, **kw: momentum(lr, nesterov=True, **kw),
    "adagrad": adagrad, "rmsprop": rmsprop, "adam": adam, "adamw": adamw, "adam_l2": adam_l2,
}


def make(name: str, learning_rate: ScalarOrSchedule, **hyper) -> optax.GradientTransformation:
    """An optimizer of this module by name, e.g. make("adamw", 3e-3, b2=0.95)."""
    if name not in OPTIMIZERS:
        raise OptimizerError(f"unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name](learning_rate, **hyper)


def optimizer_state_bytes(state) -> int:
    """Bytes held by an optimizer state (Adam in fp32: 8 per parameter, plus a 4-byte count)."""
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(state) if hasattr(x, "shape"))
