"""fp8-delayed: scales from an amax history that is training state, under every layout.

The history's own arithmetic is checked on one product (the scale from the history's
largest amax, saturation beyond it, the three amaxes reported exactly); the step's, on one
device (each step rolls its amaxes into column 0); the layouts', from one state with a
filled history: one step under each, its new column against the single device's.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import setup
from jaxscale.model import fp8, fp8_history
from jaxscale.parallel.build import build_train_step
from jaxscale.parallel.plan import Plan, PlanError
from jaxscale.parallel.step import Guard

SPEC = "btd,dhk->bthk"


def _operands():
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (2, 4, 32), jnp.bfloat16)
    w = jax.random.normal(kw, (32, 2, 8), jnp.bfloat16) * 0.1
    return x, w, jax.random.normal(kg, (2, 4, 2, 8))


def _grads(x, w, history, g):
    def f(x, w, h):
        return jnp.sum(fp8.delayed_einsum(SPEC, x, w, h).astype(jnp.float32) * g)
    return jax.grad(f, argnums=(0, 1, 2))(x, w, history)


@pytest.mark.slow
def test_a_product_scales_from_its_history_and_reports_its_amaxes():
    x, w, g = _operands()
    ax, aw = float(jnp.max(jnp.abs(x))), float(jnp.max(jnp.abs(w)))
    # a history whose activation amax is half this step's: the top half saturates
    history = jnp.zeros((3, 4)).at[0, 2].set(ax / 2).at[1, 1].set(aw).at[2, 3].set(1.0)
    y = fp8.delayed_einsum(SPEC, x, w, history)
    q, s = fp8.quantize(x, fp8.E4M3, scale=fp8.scale_for(jnp.float32(ax / 2), fp8.E4M3))
    r, t = fp8.quantize(w, fp8.E4M3, scale=fp8.scale_for(jnp.float32(aw), fp8.E4M3))
    want = jnp.einsum(SPEC, fp8.dequantize(q, s), fp8.dequantize(r, t),
                      preferred_element_type=x.dtype)
    assert float(jnp.max(jnp.abs(y.astype(jnp.float32) - want.astype(jnp.float32)))) == 0.0
    assert float(jnp.max(jnp.abs(fp8.dequantize(q, s)))) == pytest.approx(ax / 2, rel=2**-3)
    dx, dw, reported = _grads(x, w, history, g)
    dy = g.astype(jnp.bfloat16)  # the cotangent of y (bf16), as backward sees it
    assert np.asarray(reported[:, 0]).tolist() == [ax, aw, float(jnp.max(jnp.abs(dy)))]
    assert float(jnp.max(jnp.abs(reported[:, 1:]))) == 0.0  # only column 0 is new


@pytest.mark.slow
def test_an_empty_history_is_current_scaling_bit_for_bit():
    x, w, g = _operands()
    empty = jnp.zeros((3, 4))
    assert np.array_equal(fp8.delayed_einsum(SPEC, x, w, empty), fp8.einsum(SPEC, x, w))
    current = jax.grad(lambda x, w: jnp.sum(fp8.einsum(SPEC, x, w).astype(jnp.float32) * g),
                       argnums=(0, 1))(x, w)
    assert all(np.array_equal(a, b) for a, b in zip(_grads(x, w, empty, g)[:2], current))


@pytest.mark.slow
def test_each_step_rolls_its_amaxes_into_the_history():
    cfg, params, batch = setup("tiny")
    init, step = build_train_step(cfg, Plan(precision="fp8-delayed", fp8_history=2),
                                  optax.adam(1e-3))
    state = init(params)
    assert {k: v.shape for k, v in state.fp8["blocks"].items()} == {
        k: (2, 3, 2) for k in ("wq", "wk", "wv", "wo", "w1", "w2")} and "head" not in state.fp8
    first, _ = step(state, batch)
    second, _ = step(first, batch)
    for a, b in zip(jax.tree.leaves(first.fp8), jax.tree.leaves(second.fp8)):
        assert np.all(a[..., 0] > 0) and np.all(a[..., 1] == 0)  # step 1's, nothing before
        assert np.array_equal(b[..., 1], a[..., 0])  # one step on, it moved to column 1
    # a step the guard drops still rolls its amaxes in (Transformer Engine's rule: a
    # spike that saturated brings the amax its retry needs); the update is dropped
    third, metrics = step(second, batch, Guard.make(loss_max=0.0))
    assert not bool(metrics["accepted"])
    assert all(np.array_equal(a, b) for a, b in
               zip(jax.tree.leaves(third.params), jax.tree.leaves(second.params)))
    for a, b in zip(jax.tree.leaves(second.fp8), jax.tree.leaves(third.fp8)):
        assert np.array_equal(b[..., 1], a[..., 0]) and np.all(b[..., 0] > 0)
    w = np.asarray(params["blocks"]["wq"], np.float32)  # the first step's weights, bf16
    want = np.abs(np.asarray(jnp.asarray(w).astype(jnp.bfloat16), np.float32)).max(axis=(1, 2, 3))
    assert np.array_equal(first.fp8["blocks"]["wq"][:, 1, 0], want)


def test_a_non_finite_amax_is_not_rolled_in():
    """A NaN would make the history's largest amax NaN (the product would fall back to
    current scaling for H steps), an inf would scale the tensor to zero: that product
    keeps its history."""
    history = {"blocks": {"wq": jnp.arange(1.0, 13.0).reshape(1, 3, 4)}}
    amaxes = {"blocks": {"wq": jnp.array([[5.0, jnp.nan, jnp.inf]])}}
    rolled = np.asarray(fp8_history.roll(history, amaxes)["blocks"]["wq"][0])
    assert rolled.tolist() == [[5.0, 1.0, 2.0, 3.0], [5.0, 6.0, 7.0, 8.0],
                               [9.0, 10.0, 11.0, 12.0]]


# Layouts whose devices compute exactly what one device computes, row for row (the max over
# micro-batches and dp devices is then exact), and layouts that compute in other orders
EXACT = ("dp=2,zero=1,micro_batches=2", "dp=4")
NEAR = ("dp=2,zero=3", "pp=2,virtual=2,schedule=interleaved,micro_batches=4",
        "pp=2,schedule=zbv,micro_batches=4", "dp=2,tp=2,pp=2,micro_batches=4", "cp=2",
        "tp=2,sp=1")
# one FP8 step, relative: a value one bf16 ulp apart may round to the neighbouring E4M3
# (3 mantissa bits) or E5M2 (2 bits) value, and everything after it moves by up to that
ONE_STEP = np.array([2**-3, 0.0, 2**-2])  # activation, weight (exact: the same weights), gradient


@pytest.fixture(scope="module")
def filled():
    """The single device's state after one step (its history filled: every layout then
    scales alike) and its history's new column after one more step."""
    cfg, params, batch = setup("tiny8")
    init, step = build_train_step(cfg, _plan(""), optax.adam(1e-3))
    state, _ = step(init(params), batch)
    start = jax.tree.map(np.asarray, step.canonical.to_canonical(state))
    after = step.canonical.to_canonical(step(state, batch)[0]).fp8
    return cfg, batch, start, after


def _plan(layout: str) -> Plan:
    base = "precision=fp8-delayed,fp8_history=4,fp8_head=1"
    return Plan.parse(f"{layout},{base}" if layout else base)


@pytest.mark.slow
@pytest.mark.parametrize("layout", EXACT + NEAR)
def test_every_layout_rolls_in_the_single_devices_amaxes(filled, layout):
    cfg, batch, start, after = filled
    plan = _plan(layout)
    init, step = build_train_step(cfg, plan, optax.adam(1e-3), jax.devices()[:plan.n_devices])
    state, _ = step(step.canonical.from_canonical(start), batch)
    history = step.canonical.to_canonical(state).fp8
    assert jax.tree.structure(history) == jax.tree.structure(after)
    for got, want in zip(jax.tree.leaves(history), jax.tree.leaves(after)):
        got, want = np.asarray(got), np.asarray(want)
        assert np.array_equal(got[..., 1:], want[..., 1:])  # the older columns moved on
        rel = np.abs(got[..., 0] / want[..., 0] - 1).reshape(-1, 3).max(axis=0)
        assert np.all(rel <= (0.0 if layout in EXACT else ONE_STEP)), (layout, rel)


@pytest.mark.parametrize("fields,message", [
    (dict(precision="fp8-delayed", fp8_history=0), "positive integer"),
    (dict(precision="fp8", fp8_history=4), "precision=fp8-delayed"),
])
def test_bad_history_options_are_refused(fields, message):
    with pytest.raises(PlanError, match=message):
        Plan(**fields).validate()


def test_the_cli_refuses_a_history_of_zero(fail):
    assert "--fp8-history: must be an integer >= 1, got 0" in fail(
        "train", "--steps", "2", "--precision", "fp8-delayed", "--fp8-history", "0")


def test_the_history_is_held_per_layer_like_its_weights():
    shapes = {"blocks": {"wq": jnp.zeros((3, 4, 2, 2)), "w1": jnp.zeros((3, 4, 8))}}
    history = fp8_history.init(shapes, 5, head=True)
    assert {k: v.shape for k, v in history["blocks"].items()} == {"wq": (3, 3, 5), "w1": (3, 3, 5)}
    assert history["head"].shape == (3, 5)
    attached = fp8_history.attach(shapes, history)
    assert attached["blocks"][fp8_history.BLOCKS] is history["blocks"]
    assert attached[fp8_history.HEAD] is history["head"]
