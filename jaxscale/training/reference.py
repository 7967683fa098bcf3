"""The plain single-device fp32 step, the reference every strategy is checked against; the
validation step; and a fresh run's model and parameters.

For `Plan()` with fp32 the step `parallel.build.build_train_step` returns is bit-identical
to `make_train_step`'s. The loss lives in `jaxscale.model.loss`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxscale import garden
from jaxscale.model import config as model_config, transformer as modellib
from jaxscale.model.loss import loss_and_objective, nll_and_count
from jaxscale.training.config import TrainConfig, lr_schedule, make_optimizer


def make_train_step(graphdef, optimizer: optax.GradientTransformation):
    """A jitted step(params, opt_state, batch) -> (params, opt_state, metrics)."""

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = value_and_grad(graphdef, params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads),
                   "n_tokens": jnp.sum(batch["mask"])}
        return params, opt_state, metrics

    return step


def value_and_grad(graphdef, params, batch):
    """(the loss, the gradient of what training minimises: the loss, plus a mixture of
    experts' router objective, model.loss.loss_and_objective)."""
    def objective(p):
        loss, minimised = loss_and_objective(graphdef, p, batch)
        return minimised, loss
    (_, loss), grads = jax.value_and_grad(objective, has_aux=True)(params)
    return loss, grads


def make_eval_step(graphdef):
    """A jitted function batch -> (sum NLL, token count), for validation."""
    return jax.jit(lambda params, batch: nll_and_count(graphdef, params, batch)[:2])


def as_arrays(batch: garden.Batch) -> dict[str, np.ndarray]:
    return {"tokens": batch.tokens, "targets": batch.targets, "mask": batch.mask}


def evaluate(eval_step, params, batches: list[garden.Batch]) -> float:
    """Validation loss: total NLL over all validation tokens / their count."""
    total = count = 0.0
    for b in batches:
        s, c = eval_step(params, as_arrays(b))
        total += float(s)
        count += float(c)
    return total / count


def init_run(cfg: TrainConfig):
    """(graphdef, params, optimizer) for a fresh run of `cfg`.

    `graphdef` is the model's static structure; `params` the fp32 arrays as a nested dict.
    The optimizer state is built by the Plan's init, in the layout its strategy needs.
    """
    mcfg = model_config.preset(cfg.model)
    # validation runs this graph on fp32 parameters (native products whatever the precision
    # policy: the loss of the trained weights, fp8 ones too), which cuDNN's kernel does not take
    kernel = "xla" if cfg.attention == "cudnn" else cfg.attention
    model = modellib.build(mcfg, seed=cfg.seed, attention=kernel, unroll=cfg.unroll)
    graphdef, state = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(state)  # a plain nested dict of arrays; nnx.merge accepts it
    optimizer = make_optimizer(cfg.optimizer, lr_schedule(cfg), cfg.optimizer_state_dtype)
    return graphdef, params, optimizer
