"""Data parallelism on 8 forced CPU devices vs the single-device reference."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxscale import costmodel, garden
from jaxscale.measure import hlo as measure
from jaxscale.measure import compare_trees
from jaxscale.model import optim
from jaxscale.runtime.mesh import make_mesh
from jaxscale.model.loss import loss_fn, nll_and_count
from jaxscale.parallel.axes import DP
from jaxscale.parallel.data_parallel import (dp_value_and_grad, replicas_identical,
    shard_mean_of_means)
from jaxscale.parallel.plan import Plan, PlanError
from jaxscale.parallel.build import build_train_step
from jaxscale.training.config import TrainConfig
from jaxscale.training.reference import as_arrays, init_run
from jaxscale.model import config as model_config

from conftest import fp32_sum_bound

CFG = model_config.preset("tiny")


@functools.lru_cache(maxsize=1)
def setup():
    graphdef, params, _ = init_run(TrainConfig())
    it = garden.make_corpus(0).train_batches(32, seed=7)
    return graphdef, params, [as_arrays(next(it)) for _ in range(60)]


def dp_grads(graphdef, dp, micro_batches=1):
    mesh = make_mesh(f"dp={dp}", jax.devices()[:dp])
    return jax.jit(jax.shard_map(
        lambda p, b: dp_value_and_grad(graphdef, micro_batches)(p, b, None), mesh=mesh,
        in_specs=(P(), P(DP)), out_specs=(P(), P())))


@pytest.mark.slow
@pytest.mark.parametrize("dp, micro", [(8, 1), (4, 2), (2, 4)])
def test_gradients_equal_single_device(devices, dp, micro):
    graphdef, params, batches = setup()
    ref_loss, ref = jax.value_and_grad(lambda p: loss_fn(graphdef, p, batches[0]))(params)
    loss, grads = dp_grads(graphdef, dp, micro)(params, batches[0])
    assert compare_trees.max_rel_diff(grads, ref) <= 1e-5
    # the loss sums the batch's n = 608 target tokens in another order: sqrt(n) eps = 2.9e-6
    assert float(loss) == pytest.approx(float(ref_loss),
                                        rel=fp32_sum_bound(batches[0]["mask"].sum()))


@pytest.mark.slow
def test_the_other_convention_would_give_dp_times_the_gradient(devices):
    """Differentiating the replicated parameters directly already sums over dp; a psum on
    top of that (a classic bug) gives exactly 8x: the comparison above would catch it."""
    graphdef, params, batches = setup()
    mesh = make_mesh("dp=8")

    def double_counted(p, b):
        count = lax.psum(jnp.sum(b["mask"]), DP)
        g = jax.grad(lambda q: nll_and_count(graphdef, q, b)[0] / count)(p)  # implicit sum
        return lax.psum(g, DP)  # ... and an explicit one
    wrong = jax.jit(jax.shard_map(double_counted, mesh=mesh, in_specs=(P(), P(DP)),
                                  out_specs=P()))(params, batches[0])
    ref = jax.grad(lambda p: loss_fn(graphdef, p, batches[0]))(params)
    assert compare_trees.max_rel_diff(wrong, ref) > 6  # off by 7x the gradient itself
    assert compare_trees.max_rel_diff(jax.tree.map(lambda w: w / 8, wrong), ref) <= 1e-5


@pytest.mark.slow
def test_60_step_loss_curve_and_identical_replicas(devices):
    graphdef, params, batches = setup()
    opt = optim.adamw(3e-3)
    init1, step1 = build_train_step(CFG, Plan(), opt)
    init8, step8 = build_train_step(CFG, Plan(dp=8), opt)
    a, b = init1(params), init8(params)
    worst = 0.0
    for batch in batches:
        a, ma = step1(a, batch)
        b, mb = step8(b, batch)
        worst = max(worst, abs(float(mb["loss"]) - float(ma["loss"])) / float(ma["loss"]))
        assert replicas_identical((b.params, b.opt_state))  # each device's own copy
    # a loss curve: each step sums its n <= 825 tokens in another order (c = 1) and the
    # parameters drift apart by rounding; c = 3 (1.0e-5) leaves room for both
    assert worst <= fp32_sum_bound(max(x["mask"].sum() for x in batches), c=3), worst  # 1.1e-6


@pytest.mark.slow
def test_accumulation_equals_one_big_batch_and_mean_of_means_does_not():
    """Day-4 §4.3: micro-batches of 500 / 100 / 400 / 50 target tokens."""
    graphdef, params, _ = setup()
    pool, micro = iter(garden.make_corpus(0).train), []
    for want in (500, 100, 400, 50):  # fill up to 32 rows, then pad with empty documents
        group, total = [], 0
        for d in pool:
            if total + len(d) - 1 <= want and len(group) < 32:
                group.append(d)
                total += len(d) - 1
            if want - total < 8:
                break
        empty = np.array([garden.BOS_ID], np.int32)
        micro.append(as_arrays(garden.make_batch(group + [empty] * (32 - len(group)), 64)))
    counts = [float(m["mask"].sum()) for m in micro]
    big = jax.tree.map(lambda *x: np.concatenate(x), *micro)
    ref_loss, ref = jax.value_and_grad(lambda p: loss_fn(graphdef, p, big))(params)
    sums = [jax.value_and_grad(lambda p, m=m: nll_and_count(graphdef, p, m)[0])(params)
            for m in micro]
    acc = jax.tree.map(lambda *g: sum(g) / sum(counts), *[g for _, g in sums])
    # each gradient entry sums the n = 1,045 tokens' contributions in another order
    assert compare_trees.max_rel_diff(acc, ref) <= fp32_sum_bound(sum(counts))  # 3.9e-6
    mean_of_means = np.mean([float(s) / c for (s, _), c in zip(sums, counts)])
    assert abs(mean_of_means - float(ref_loss)) > 1e-3
    assert all(abs(c - w) < 8 for c, w in zip(counts, (500, 100, 400, 50))), counts


def test_gradients_reduced_once_per_step_not_per_micro_batch(devices):
    graphdef, params, batches = setup()
    n_params = model_config.param_count(CFG)
    per = {}
    for micro in (1, 4):
        hlo = dp_grads(graphdef, 8, micro).lower(params, batches[0]).as_text(dialect="hlo")
        reductions = [c for c in measure.collectives(hlo) if c.op == "all-reduce"]
        grad_bytes = sum(c.nbytes for c in reductions if any(len(d) for _, d in c.shapes))
        per[micro] = (len(reductions), grad_bytes)
        # the cost model's payload, exactly: the fp32 gradients, once
        assert grad_bytes == costmodel.dp_gradient_allreduce(n_params, 8)["payload_bytes"]
    assert per[1] == per[4]


def test_mean_of_shard_means_is_wrong_when_token_counts_differ(devices):
    graphdef, params, batches = setup()
    r = shard_mean_of_means(graphdef, params, batches[0], 8)
    assert len(set(r["tokens_per_shard"])) > 1
    assert r["token_weighted"] == pytest.approx(float(loss_fn(graphdef, params, batches[0])),
                                                rel=fp32_sum_bound(batches[0]["mask"].sum()))
    assert r["difference"] != 0.0


@pytest.mark.parametrize("plan, kwargs, message", [
    (Plan(dp=8), dict(global_batch=12), "12 documents is not divisible by dp x micro_batches = 8 x 1"),
    (Plan(dp=2, micro_batches=4), dict(global_batch=12), "multiple of 8"),
    (Plan(dp=4), dict(n_devices=8), "needs 4 devices but 8 are available"),
    (Plan(micro_batches=0), {}, "micro_batches must be a positive integer, got 0"),
    (Plan(zero_stage=5), {}, "zero_stage must be 0, 1, 2 or 3, got 5"),
    (Plan(schedule="zigzag"), {}, "unknown pipeline schedule 'zigzag'"),
    (Plan(precision="fp4"), {}, "unknown precision policy 'fp4'"),
    (Plan(pp=2, micro_batches=2, schedule="interleaved"), {}, "interleaved needs"),
])
def test_plan_validation(plan, kwargs, message):
    with pytest.raises(PlanError, match=message):
        plan.validate(**kwargs)
