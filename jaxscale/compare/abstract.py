"""`jaxscale compare --abstract`: every plan lowered and compiled on abstract (never
allocated) state, in this process; XLA's per-device memory beside the formula's
(compare.predict). Nothing runs, so nothing can crash a collective."""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
from flax import nnx

from jaxscale.compare.predict import predict
from jaxscale.compare.run import mesh_label
from jaxscale.measure import memory
from jaxscale.model import optim, transformer as modellib
from jaxscale.parallel.build import build_train_step


def run_abstract(cfg, plans: dict, devices, batch_size: int) -> list[dict]:
    """Lower and compile each plan on abstract (never allocated) state; XLA's memory."""
    params = nnx.to_pure_dict(nnx.state(modellib.abstract(cfg), nnx.Param))
    rows = []
    for i, (name, plan) in enumerate(plans.items()):
        print(f"[{i + 1}/{len(plans)}] {name}: {mesh_label(plan.as_dict())}, compiling ...",
              file=sys.stderr, flush=True)
        init, step = build_train_step(cfg, plan, optim.adamw(3e-3), devices[:plan.n_devices])
        state = jax.eval_shape(init, params)
        sharding = step.batch_sharding
        spec = lambda dt: jax.ShapeDtypeStruct((batch_size, cfg.seq_len), dt,  # noqa: E731
                                               sharding=sharding)
        batch = {"tokens": spec(jnp.int32), "targets": spec(jnp.int32),
                 "mask": spec(jnp.float32)}
        compiled = step.jitted.lower(state, batch).compile()
        mem = memory.memory(compiled)
        pred = predict(cfg, plan, (batch_size, cfg.seq_len))["states"]
        batch_bytes = 12 * batch_size * cfg.seq_len // plan.dp
        states = mem["arguments"] - batch_bytes
        rows.append({"name": name, "plan": plan.as_dict(), "mesh": mesh_label(plan.as_dict()),
                     "memory": mem, "states_measured": states,
                     "states_predicted": pred["params"] + pred["optimizer"],
                     "rel_diff": states / (pred["params"] + pred["optimizer"]) - 1,
                     "grads_predicted": pred["grads"]})
    return rows
