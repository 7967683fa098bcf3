"""The language-model loss: token NLL summed over the batch, divided by the token count.

Never a mean of per-sequence (or per-shard, or per-micro-batch) means: that would weight a
10-token document like a 50-token one. Data parallelism and gradient accumulation reuse
`nll_and_count` and divide by the global count.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx


def nll_and_count(graphdef, params, batch, history=None) -> tuple:
    """(sum of target-token NLLs, number of target tokens) over a batch; padding excluded.
    `history`: fp8-delayed's amax histories (jaxscale.model.fp8_history), if any. A
    mixture of experts adds its routers' statistics third (jaxscale.model.moe)."""
    logits, stats = nnx.merge(graphdef, params).with_stats(batch["tokens"], history)
    total, count = logits_nll_and_count(logits, batch)
    return (total, count, stats) if stats else (total, count)


def logits_nll_and_count(logits, batch) -> tuple[jax.Array, jax.Array]:
    """nll_and_count from the model's logits (for callers that run the forward themselves)."""
    nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                          batch["targets"])
    mask = batch["mask"]
    return jnp.sum(nll * mask), jnp.sum(mask)


def loss_and_objective(graphdef, params, batch) -> tuple[jax.Array, jax.Array]:
    """(the loss, what training minimises): the loss plus a mixture of experts' routers'
    objective (their load-balancing and z-losses, weighted; jaxscale.model.moe), or the
    loss itself for a dense model."""
    out = nll_and_count(graphdef, params, batch)
    loss = out[0] / out[1]
    return loss, loss + out[2]["objective"] if len(out) > 2 else loss


def loss_fn(graphdef, params, batch, history=None) -> jax.Array:
    """Mean NLL per target token of the whole batch (sum / count, not a mean of means)."""
    total, count = nll_and_count(graphdef, params, batch, history)[:2]
    return total / count
