"""The training step and its state, for every precision policy and every layout.

A `TrainState` holds the working parameters (in the policy's compute dtype), an optional
fp32 master copy that receives the updates, the optimizer state, and the loss scale with
its counters. `make_step` builds the step for a policy:

    working params (compute dtype) --forward/backward, loss x scale--> grads (compute dtype)
    grads -> fp32, / scale -> finite? -> optimizer update of the master (fp32) or of the
    working params themselves (pure low precision) -> working params = cast(master)

Dynamic loss scaling: a non-finite gradient skips the update (params, master and optimizer
state unchanged) and halves the scale; `growth_interval` finite steps in a row double it.

The spike guard (jaxscale.training.spikes) uses the same skip: given a `Guard`, the step also
drops an update whose global loss or gradient norm is above the guard's limits, or
non-finite, whatever the policy; the guard's factor scales the update (the learning rate,
raised by a fault or lowered after a rollback) without recompiling.

Where the optimizer's copy lives and how per-slice values become global is the layout's
(`parallel.layouts.Replicated` on one device; ZeRO's slices in `parallel.zero`). Every
Plan's builder returns a `PlanStep`: the compiled step (`shard_step`: one shard_map over
the mesh), with the batch and guard placed on it and the state's canonical conversion.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxscale.model import fp8_history, moe
from jaxscale.model.loss import nll_and_count
from jaxscale.model.precision import Policy
from jaxscale.parallel.axes import DP
from jaxscale.parallel.layouts import Replicated


class TrainState(NamedTuple):
    params: Any  # working parameters, in the policy's compute dtype
    master: Any  # fp32 master parameters, or None
    opt_state: Any
    loss_scale: jax.Array  # float32 scalar; 1.0 without scaling
    good_steps: jax.Array  # int32: finite steps since the scale last changed
    skipped: jax.Array  # int32: updates skipped so far for non-finite gradients
    fp8: Any = None  # fp8-delayed's amax histories (jaxscale.model.fp8_history), or None


class Guard(NamedTuple):
    """Per-step inputs of a guarded step, float32 scalars on every device (the same on
    every process: they come from globally reduced metrics)."""

    loss_max: jax.Array  # the update is dropped if the global loss is above this ...
    norm_max: jax.Array  # ... or the global gradient norm above this (inf: no limit)
    lr_factor: jax.Array  # multiplies the update, i.e. the learning rate

    @classmethod
    def make(cls, loss_max=np.inf, norm_max=np.inf, lr_factor=1.0) -> "Guard":
        return cls(*(np.float32(v) for v in (loss_max, norm_max, lr_factor)))


def _times(x, factor):
    """x * factor, and exactly x when factor is 1. (A plain x * factor, though x * 1.0 == x,
    changes the plain step's bits: XLA fuses it with the ops that made x and rounds them
    differently. Through a select the step stays bit-identical to the plain one; measured,
    tests/training/test_spikes.py. A factor on the gradients did not, even so: a NaN fault is
    injected through the batch instead, jaxscale.training.faults.poison.)"""
    return jnp.where(factor == 1, x, (x * factor).astype(x.dtype))


def _cast(tree, dtype):
    return jax.tree.map(lambda x: x.astype(dtype), tree)


def init_state(params32, optimizer: optax.GradientTransformation, pol: Policy,
               arrange=None, arrange_params: bool = False) -> TrainState:
    """The training state for fp32 initial parameters under `pol`.

    `arrange` lays out the optimizer's copy (master weights, or the working params it
    updates) and hence its state, e.g. ZeRO's flat slices; `arrange_params` applies it to
    the working parameters too. Default: whole tensors.
    """
    arrange = (lambda tree: tree) if arrange is None else arrange
    working = _cast(params32, pol.compute_dtype)
    master = arrange(params32) if pol.master_weights else None
    opt_state = optimizer.init(master if pol.master_weights else arrange(working))
    scale = pol.initial_scale if pol.loss_scale != "none" else 1.0
    history = (fp8_history.init(params32, pol.fp8_history, pol.fp8_head)
               if pol.matmul == "fp8-delayed" else None)
    return TrainState(arrange(working) if arrange_params else working, master, opt_state,
                      jnp.float32(scale), jnp.int32(0), jnp.int32(0), history)


def local_value_and_grad(graphdef):
    """grad_fn for one device: (loss, gradients of loss x multiplier); multiplier None = 1.
    With fp8-delayed's `history` it returns this step's amaxes third (see make_step). A
    mixture of experts differentiates the loss plus its routers' objective and reports
    their figures with the loss (`with_router`)."""
    def grad_fn(params, batch, multiplier, history=None):
        def scaled(p, h):
            out = nll_and_count(graphdef, p, batch, h)
            loss = out[0] / out[1]
            objective = loss + out[2]["objective"] if len(out) > 2 else loss
            # no multiply at all when nothing is scaled: fp32 stays bit-identical to the plain step
            return (objective if multiplier is None else objective * multiplier), (
                with_router(loss, out[2] if len(out) > 2 else {}))
        if history is None:
            (_, loss), grads = jax.value_and_grad(scaled, has_aux=True)(params, None)
            return loss, grads
        (_, loss), (grads, reported) = jax.value_and_grad(scaled, argnums=(0, 1),
                                                          has_aux=True)(params, history)
        return loss, grads, fp8_history.newest(reported)
    return grad_fn


def with_router(loss, stats: dict, axes=()):
    """What a grad_fn returns as its loss: the loss itself, or with a mixture of experts
    {"loss": loss, "moe_aux": ..., ...}, the routers' figures (jaxscale.model.moe.metrics;
    `axes`: the mesh axes their contributions are summed over). make_step reports them."""
    return {"loss": loss, **moe.metrics(stats, axes)} if stats else loss


def make_step(graphdef, optimizer: optax.GradientTransformation, pol: Policy,
              batch_factor: float | jax.Array = 1.0, grad_fn=None, jit: bool = True,
              layout=None):
    """A step(state, batch, guard=None) -> (state, metrics) applying `pol` (jitted unless
    jit=False); with a `Guard` (or its vector, PlanStep.place_guard), an update outside
    its limits is dropped (see the top).

    batch_factor > 1 divides the loss before the backward pass and multiplies the fp32
    gradients back afterwards: the low-precision backward pass then carries gradients as
    small as a batch that many times larger would give, while the update stays the same.
    `grad_fn(params, batch, multiplier) -> (loss, grads)` computes the gradients (default:
    on one device; the data-parallel step passes one that reduces them over the mesh); they
    come in the `layout` of the optimizer's target (default `Replicated()`: whole tensors).
    Under fp8-delayed it takes the state's amax histories fourth and returns the step's
    amaxes third (a max over the step's micro-batches and devices), which the step rolls
    into the histories (jaxscale.model.fp8_history).
    """
    layout = Replicated() if layout is None else layout
    plain = pol.loss_scale == "none" and isinstance(batch_factor, (int, float)) and batch_factor == 1
    grad_fn = local_value_and_grad(graphdef) if grad_fn is None else grad_fn

    def step(state: TrainState, batch, guard: Guard | jax.Array | None = None):
        if guard is not None:  # a Guard, or its three scalars as one vector
            guard = Guard(*(guard[i] for i in range(3)))
        multiplier = None if plain else state.loss_scale / batch_factor
        history = state.fp8
        if history is None:
            loss, grads = grad_fn(state.params, batch, multiplier)
        else:
            loss, grads, amaxes = grad_fn(state.params, batch, multiplier, history)
            history = fp8_history.roll(history, amaxes)
        router = {}
        if isinstance(loss, dict):  # the loss with a mixture of experts' figures
            router = {k: v for k, v in loss.items() if k != "loss"}
            loss = loss["loss"]
        unscale = batch_factor / state.loss_scale
        grads32 = jax.tree.map(lambda g: g.astype(jnp.float32) * (1 if plain else unscale), grads)
        finite = layout.all_finite(
            jnp.all(jnp.array([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads32)])))
        grad_norm = layout.norm(grads32)
        target = state.master if pol.master_weights else layout.target(state.params)
        g = grads32 if pol.master_weights else _cast(grads32, pol.compute_dtype)
        updates, opt_state = optimizer.update(g, state.opt_state, target)
        if guard is not None:  # the learning rate's factor, after a jump or a rollback
            updates = jax.tree.map(lambda u: _times(u, guard.lr_factor), updates)
        new_target = optax.apply_updates(target, updates)
        moved = [(u != 0) for u in jax.tree.leaves(updates)]
        lost = [m & (a == b) for m, a, b in
                zip(moved, jax.tree.leaves(new_target), jax.tree.leaves(target))]
        swallowed = (layout.global_sum(sum(x.sum() for x in lost))
                     / jnp.maximum(layout.global_sum(sum(m.sum() for m in moved)), 1))
        if pol.master_weights:
            new_master = new_target
            new_params = layout.params(_cast(new_target, pol.compute_dtype))
        else:
            new_master, new_params = None, layout.params(new_target)

        apply = finite if pol.loss_scale == "dynamic" else jnp.bool_(True)
        accepted = jnp.bool_(True)
        if guard is not None:  # the loss and norm are global: every device decides alike
            accepted = (finite & jnp.isfinite(loss) & (loss <= guard.loss_max)
                        & (grad_norm <= guard.norm_max))
            apply = apply & accepted
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(apply, n, o), new, old)  # noqa: E731
        scale, good = state.loss_scale, state.good_steps
        if pol.loss_scale == "dynamic":
            grow = finite & (good + 1 >= pol.growth_interval)
            scale = jnp.where(finite, jnp.where(grow, scale * 2, scale), scale / 2)
            good = jnp.where(finite & ~grow, good + 1, 0)
        new_state = TrainState(keep(new_params, state.params), keep(new_master, state.master),
                               keep(opt_state, state.opt_state), scale, good,
                               state.skipped + (~apply).astype(jnp.int32), history)
        metrics = {"loss": loss, "grad_norm": grad_norm, "finite": finite,
                   "loss_scale": state.loss_scale, "skipped": new_state.skipped,
                   "swallowed": swallowed, "accepted": accepted, **router}
        return new_state, metrics

    return jax.jit(step) if jit else step


def state_bytes_per_param(state: TrainState, grads, n_params: int) -> dict[str, float]:
    """Bytes per parameter measured from a real TrainState and the step's gradient tree
    (arrays or jax.eval_shape's ShapeDtypeStructs); the optimizer's step count is left out."""
    def per_param(tree, arrays_only=False):
        leaves = [x for x in jax.tree.leaves(tree) if not (arrays_only and x.ndim == 0)]
        return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in leaves) / n_params
    return {"params": per_param(state.params), "grads": per_param(grads),
            "master": per_param(state.master), "optimizer": per_param(state.opt_state, True)}


class PlanStep:
    """step(state, batch, guard=None) -> (state, metrics), what every Plan's builder
    returns: puts the batch's rows on the dp axis (`place_batch`; one device: `mesh` None),
    then runs `jitted`, the compiled program (lower it to read its HLO), or with a
    `Guard` its guarded twin `guarded` (compiled on first use: a run without a
    guard never builds it). `full_params(state)` gives whole parameters (ZeRO-3 and tp/pp
    layouts pass their own: they store shards); `canonical` converts the whole state to
    and from the plan-independent form that checkpoints hold (jaxscale.parallel.canonical)."""

    def __init__(self, mesh, jitted, full_params=None, canonical=None, guarded=None):
        self.mesh, self.jitted, self.canonical = mesh, jitted, canonical
        self.guarded = guarded or jitted  # one device: a plain jit takes the guard as is
        self.full_params = full_params or (lambda state: state.params)
        self.batch_sharding = None if mesh is None else NamedSharding(mesh, P(DP))
        self.guard_sharding = None if mesh is None else NamedSharding(mesh, P())

    def place_batch(self, batch: dict) -> dict:
        return jax.device_put({k: batch[k] for k in ("tokens", "targets", "mask")},
                              self.batch_sharding)

    def place_guard(self, guard: Guard) -> jax.Array:
        """The guard's scalars as one float32 vector on every device of the mesh (every
        process gives the same): one transfer a step, not one per scalar."""
        return jax.device_put(np.asarray(guard, np.float32), self.guard_sharding)

    def __call__(self, state, batch, guard: Guard | None = None):
        if guard is None:
            return self.jitted(state, self.place_batch(batch))
        return self.guarded(state, self.place_batch(batch), self.place_guard(guard))


def shard_step(update, mesh, state_specs, prepare=None, batch_spec=P(DP)) -> tuple:
    """(step, guarded step): `update` (steplib.make_step, jit=False) in one shard_map over
    `mesh`, the state on `state_specs`, the batch's rows on dp, the guard's vector
    replicated (PlanStep.place_guard). With `prepare`, the batch (every row placed on
    dp, whole) is first rearranged by it under the same jit and split as `batch_spec` says
    (context parallelism: tokens in ring order, split over dp and cp)."""
    def build(*in_specs):
        mapped = jax.shard_map(update, mesh=mesh, in_specs=in_specs,
                               out_specs=(state_specs, P()))
        if prepare is None:
            return jax.jit(mapped)
        return jax.jit(lambda state, batch, *guard: mapped(state, prepare(batch), *guard))
    return build(state_specs, batch_spec), build(state_specs, batch_spec, P())
