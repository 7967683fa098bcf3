"""The one function that turns a Plan into a training step: `build_train_step`.

Plan() runs on one device as a plain jit; every other plan runs in one shard_map over a
mesh: data parallel (`data_parallel`), ZeRO on dp (`zero`), or with tp / pp / cp / ep
(`hybrid`, which composes `pipeline`, `context` and ZeRO on model-parallel shards; a
mixture of experts always runs there, where its routers learn which axes hold tokens).
"""
from __future__ import annotations

import jax
import optax
from flax import nnx

from jaxscale.model import attention, transformer as modellib
from jaxscale.model.config import ModelConfig
from jaxscale.parallel import layouts, step as steplib
from jaxscale.parallel.canonical import Canonical
from jaxscale.parallel.step import PlanStep
from jaxscale.parallel.data_parallel import build_data_parallel
from jaxscale.parallel.fits import check_divisible
from jaxscale.parallel.hybrid import build_hybrid
from jaxscale.parallel.plan import Plan, PlanError
from jaxscale.parallel.zero import build_zero


def build_train_step(model_cfg: ModelConfig, plan: Plan,
                     optimizer: optax.GradientTransformation, devices=None):
    """(init, step) for `plan`: init(params32) -> state; step(state, batch) -> (state, metrics).

    Plan() runs on one device; every other plan runs in one shard_map over a mesh of
    `devices` (default: the first plan.n_devices of jax.devices()).
    """
    plan.validate()
    check_divisible(model_cfg, plan)  # the model's shape against the layout, fp8-block's tiles
    for platform in {d.platform for d in (jax.devices() if devices is None else devices)}:
        try:
            attention.check_kernel(plan.attention, platform)
        except attention.KernelError as e:
            raise PlanError(str(e)) from None
    pol = plan.policy()  # (fp8-delayed: with the plan's history options)
    graphdef = nnx.graphdef(modellib.abstract(model_cfg, remat=plan.remat,
                                              attention=plan.attention, unroll=plan.unroll,
                                              matmul=pol.matmul, fp8_block=plan.fp8_block,
                                              fp8_head=plan.fp8_head))
    abstract = modellib.abstract(model_cfg)
    shapes = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
    if model_cfg.document_mask and (plan.attention == "cudnn" or plan.pp > 1 or (
            plan.zero_stage == 3 and plan.n_devices == plan.dp)):
        raise PlanError(f"the model masks attention to documents, which {plan.layout()} does "
                        "not yet: use attention einsum or xla, no pipeline, and ZeRO-3 only "
                        "with tp or cp")
    moe = model_cfg.n_experts and (plan.n_devices > 1 or plan.micro_batches > 1)
    if plan.tp > 1 or plan.pp > 1 or plan.cp > 1 or plan.ep > 1 or moe:  # (sp needs tp > 1)
        return build_hybrid(model_cfg, graphdef, plan, optimizer, pol, shapes,
                            modellib.logical_axes(abstract), devices)
    if plan.zero_stage:
        return build_zero(graphdef, plan, optimizer, pol, shapes, devices, plan.family(model_cfg))
    if plan.n_devices == 1 and plan.micro_batches == 1:  # the reference: a plain jit
        canonical = Canonical(layouts.Replicated(), optimizer, pol, shapes, None)
        step = PlanStep(None, steplib.make_step(graphdef, optimizer, pol),
                           canonical=canonical)
        return (lambda params32: steplib.init_state(params32, optimizer, pol)), step
    return build_data_parallel(graphdef, plan, optimizer, pol, shapes, devices)
