"""Tensor parallelism (Megatron) on forced CPU devices against the unsharded model."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxscale.measure import hlo as measure
from jaxscale.measure import compare_trees
from jaxscale.model import transformer as M, optim
from jaxscale.runtime.mesh import make_mesh
from jaxscale.parallel.hybrid import param_specs
from jaxscale.parallel.plan import Plan, PlanError
from jaxscale.parallel.build import build_train_step

from conftest import fp32_sum_bound, one_step, setup
from jaxscale.model import config as model_config


@pytest.mark.parametrize("model, tp", [("tiny", 2), ("tiny", 4), ("tiny8", 8)])
def test_block_output_equals_the_unsharded_block(devices, model, tp):
    cfg, params, batch = setup(model)
    layer0 = jax.tree.map(lambda x: x[0], params["blocks"])
    x = M.embed(params, jnp.asarray(batch["tokens"][:4]))
    axes = jax.tree.map(lambda a: a[1:], M.logical_axes(M.abstract(cfg))["blocks"],
                        is_leaf=lambda a: isinstance(a, tuple))
    specs = param_specs(axes, Plan(tp=tp))
    mesh = make_mesh(f"tp={tp}", devices[:tp])
    sharded = jax.jit(jax.shard_map(lambda p, h: M.block(p, h, "tp"), mesh=mesh,
                                    in_specs=(specs, P()), out_specs=P()))
    diff = float(jnp.max(jnp.abs(sharded(layer0, x) - M.block(layer0, x))))
    assert diff <= 1e-5


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.slow
def test_loss_and_gradients_equal_the_single_device(devices, tp):
    """Each device sums its heads' partial outputs in another order: measured ~1e-7 of
    each tensor's scale; bound 1e-5 (per tensor, floored at 1e-4 of the largest gradient,
    for the key bias whose exact gradient is 0). The loss, a sum over n = 682 target tokens
    in another order: within fp32_sum_bound(n) = sqrt(n) eps_fp32 = 3.1e-6 relative."""
    ref, ref_loss, _, _ = one_step("tiny")
    grads, loss, _, _ = one_step("tiny", tp=tp)
    assert abs(loss - ref_loss) <= fp32_sum_bound(setup("tiny")[2]["mask"].sum()) * ref_loss
    assert compare_trees.max_rel_diff(grads, ref) <= 1e-5


@pytest.mark.slow
def test_split_tensors_take_one_tpth_per_device(devices):
    _, _, _, state = one_step("tiny", tp=4)
    on_0 = lambda x: sum(s.data.nbytes for s in x.addressable_shards  # noqa: E731
                         if s.device == jax.devices()[0])
    b = state.params["blocks"]
    for name in ("wq", "wk", "wv", "wo", "bq", "w1", "b1", "w2"):
        assert on_0(b[name]) * 4 == b[name].nbytes, name
    for name in ("bo", "b2"):
        assert on_0(b[name]) == b[name].nbytes, name  # replicated
    assert on_0(state.params["tok_embed"]) == state.params["tok_embed"].nbytes


@pytest.mark.slow
def test_two_all_reduces_per_layer_forward_and_two_backward(devices):
    """The forward alone (the loss) has 2 per layer; the whole step 4: backward adds 2."""
    cfg, params, batch = setup("tiny")
    _, _, step, state = one_step("tiny", tp=2)
    hlo = step.jitted.lower(state, step.place_batch(batch)).as_text(dialect="hlo")
    tp = measure.bytes_by_axis(hlo, {"dp": 1, "pp": 1, "tp": 2})["tp"]
    assert set(tp) == {"all-reduce"}
    b, s = batch["tokens"].shape
    assert tp["all-reduce"]["count"] == 4 * cfg.n_layers
    assert tp["all-reduce"]["bytes"] == 4 * cfg.n_layers * b * s * cfg.d_model * 4
    specs = param_specs(M.logical_axes(M.abstract(cfg)), Plan(tp=2))
    forward = jax.jit(jax.shard_map(lambda p, t: M.forward(p, t, tp_axis="tp").sum(),
                                    mesh=make_mesh("tp=2", devices[:2]),
                                    in_specs=(specs, P()), out_specs=P()))
    hlo = forward.lower(params, batch["tokens"]).as_text(dialect="hlo")
    fwd = measure.bytes_by_axis(hlo, {"tp": 2})["tp"]["all-reduce"]
    assert fwd["count"] == 2 * cfg.n_layers


def test_the_wrong_split_differs_because_gelu_is_not_additive():
    """Splitting W1 by input rows leaves each device a partial pre-activation a_i; GELU of
    the parts is not GELU of the sum."""
    cfg, params, batch = setup("tiny")
    p = jax.tree.map(lambda x: x[0], params["blocks"])
    x = M.embed(params, jnp.asarray(batch["tokens"][:4]))
    x = M.layer_norm(x, p["ln2"]["scale"], p["ln2"]["bias"])  # what the MLP sees in a block
    right = M.mlp(p, x)
    halves = np.split(np.arange(cfg.d_model), 2)
    wrong = sum(jax.nn.gelu(x[..., i] @ p["w1"][i] + p["b1"] / 2) for i in halves) @ p["w2"] \
        + p["b2"]
    assert float(jnp.max(jnp.abs(wrong - right))) > 1e-2 * float(jnp.max(jnp.abs(right)))


def test_tp_must_divide_heads_and_width():
    cfg = model_config.preset("tiny")
    with pytest.raises(PlanError, match=r"tp=8 must divide the heads \(4\)"):
        build_train_step(cfg, Plan(tp=8), optim.sgd(1.0))
