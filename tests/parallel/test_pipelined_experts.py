"""A mixture of experts in a pipeline against one device: each stage's backward takes its
own routers' objective (a split backward: in B and in W), their figures are joined over
the stages, and the stages hold experts in every block or (interleaved, moe_every) whole
groups of blocks; with ep, tp, dp and ZeRO; the ring bytes at compare.predict's; the
layouts refused by name."""
import dataclasses

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from jaxscale.compare.predict import predict
from jaxscale.measure import compare_trees, hlo
from jaxscale.model import config as model_config, transformer as modellib
from jaxscale.parallel.build import build_train_step
from jaxscale.parallel.plan import Plan, PlanError
from jaxscale.parallel.tick_table import tick_table

from conftest import KEEP_GRADIENT, fp32_sum_bound, setup

# (model, its blocks, the plan): tiny-switch holds experts in every second block
PIPELINED = {"pp2-ep2": ("tiny-moe", 2, dict(pp=2, ep=2, micro_batches=2)),
             "pp2-ep2-tp2": ("tiny-moe", 2, dict(pp=2, ep=2, tp=2, micro_batches=2)),
             "pp2-dp2-ep2": ("tiny-moe", 2, dict(pp=2, dp=2, ep=2, micro_batches=2)),
             "pp2-dp2-ep2-zero3": ("tiny-moe", 2, dict(pp=2, dp=2, ep=2, zero_stage=3,
                                                       micro_batches=2)),
             "zbh1-pp2-ep2-tp2": ("tiny-moe", 2, dict(pp=2, ep=2, tp=2, micro_batches=2,
                                                      schedule="zb-h1")),
             "zbv4-pp2-ep2": ("tiny-moe", 4, dict(pp=2, ep=2, micro_batches=4, virtual=2,
                                                  schedule="zbv")),
             "switch-pp2-ep2": ("tiny-switch", 4, dict(pp=2, ep=2, micro_batches=2)),
             "switch8-pp2-ep2-v2": ("tiny-switch", 8, dict(pp=2, ep=2, micro_batches=2,
                                                           virtual=2, schedule="interleaved")),
             "switch8-zbv4-pp2-ep2": ("tiny-switch", 8, dict(pp=2, ep=2, micro_batches=4,
                                                             virtual=2, schedule="zbv")),
             "switch-pp2-dp2-ep2-zero3": ("tiny-switch", 4, dict(pp=2, dp=2, ep=2, zero_stage=3,
                                                                 micro_batches=2))}


def _model(name: str, layers: int):
    cfg = dataclasses.replace(model_config.preset(name), n_layers=layers)
    return cfg, nnx.to_pure_dict(nnx.state(modellib.build(cfg), nnx.Param))


def _run(cfg, params, plan: Plan, batch):
    """(whole gradient, metrics, step, initial state) of one step."""
    init, step = build_train_step(cfg, plan, KEEP_GRADIENT, jax.devices()[:plan.n_devices])
    state = init(params)
    new, metrics = step(state, batch)
    return step.full_params(new._replace(params=new.opt_state[0].trace)), metrics, step, state


@pytest.mark.slow
@pytest.mark.parametrize("name", PIPELINED)
def test_pipelined_experts_equal_one_device(name):
    """One step (1F1B over pp=2, interleaved over 2 chunks a device, or zero-bubble: zb-h1,
    and zbv's V of 2 chunks) equals one device's with the same micro-batches (device d's j-th share of its rows in
    micro-batch j: the router's losses are each micro-batch's): the loss within
    fp32_sum_bound(n), every gradient within 1e-5 relative, the router's figures within
    1e-5 relative; the program's ring bytes per collective equal compare.predict's
    (rel 1e-12: integers held in floats), the pipeline's branches counted by the tick
    table's shares."""
    model, layers, kw = PIPELINED[name]
    cfg, params = _model(model, layers)
    batch, plan = setup("tiny-moe")[2], Plan(**kw)
    rows, devices, m = len(batch["tokens"]), plan.dp * plan.ep, plan.micro_batches
    order = np.arange(rows).reshape(devices, m, -1).transpose(1, 0, 2).ravel()
    ref, theirs = _run(cfg, params, Plan(micro_batches=m),
                       {k: v[order] for k, v in batch.items()})[:2]
    grads, ours, step, state = _run(cfg, params, plan, batch)
    loss, ref_loss = float(ours["loss"]), float(theirs["loss"])
    assert abs(loss - ref_loss) <= fp32_sum_bound(batch["mask"].sum()) * ref_loss
    assert compare_trees.max_rel_diff(grads, ref) <= 1e-5
    for figure in ("moe_aux", "moe_z", "moe_dropped", "moe_load_max"):
        assert float(ours[figure]) == pytest.approx(float(theirs[figure]), rel=1e-5,
                                                    abs=1e-7), figure
    text = step.jitted.lower(state, step.place_batch(batch)).as_text(dialect="hlo")
    share = tick_table(plan.schedule, plan.pp, m, plan.virtual).branch_share()
    assert predict(cfg, plan, batch["tokens"].shape)["sent"] == pytest.approx(
        hlo.ring_bytes_by_op(text, share, n_devices=plan.n_devices), rel=1e-12)


@pytest.mark.parametrize("model, layers, plan, words", [
    ("tiny-switch", 4, dict(pp=4, micro_batches=4),
     "4 chunks must each hold whole groups of moe_every=2 blocks (the 4 layers make 2) | "
     "with virtual=1 choose pp from [1, 2]"),
    ("tiny-switch", 8, dict(pp=2, virtual=4, micro_batches=2, schedule="interleaved"),
     "8 chunks must each hold whole groups of moe_every=2 | with pp=2 choose virtual from "
     "[1, 2]"),
], ids=["groups-over-stages", "groups-over-chunks"])
def test_pipelined_experts_refused_by_name(model, layers, plan, words):
    """One line naming the bad value and what fits (each phrase of `words`, split at
    " | ", in it), before anything is compiled."""
    cfg = dataclasses.replace(model_config.preset(model), n_layers=layers)
    with pytest.raises(PlanError) as refused:
        build_train_step(cfg, Plan(**plan), optax.sgd(0.1))
    assert all(w in str(refused.value) for w in words.split(" | ")), str(refused.value)
