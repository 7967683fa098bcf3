"""Number formats and the mixed-precision step, with real bfloat16 / float16 arithmetic."""
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxscale import garden
from jaxscale.model import optim, precision as P
from jaxscale.training import sweep
from jaxscale.model.config import param_count, preset
from jaxscale.training.config import TrainConfig
from jaxscale.training.reference import init_run, make_train_step
from jaxscale.model import formats
from jaxscale.parallel import step as steplib


@functools.lru_cache(maxsize=1)
def setup():
    graphdef, params, _ = init_run(TrainConfig())
    batches = sweep.stack_batches(garden.make_corpus(0), 8, 8, seed=3)
    return graphdef, params, [jax.tree.map(lambda x, i=i: x[i], batches) for i in range(8)]


def test_format_table_is_ml_dtypes_finfo():
    rows = {r["format"]: r for r in formats.format_table()}
    assert list(rows) == ["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]
    for name, r in rows.items():
        fi = ml_dtypes.finfo(formats.FORMATS[name])
        assert (r["max"], r["smallest_normal"], r["smallest_subnormal"], r["eps"]) == (
            float(fi.max), float(fi.smallest_normal), float(fi.smallest_subnormal), float(fi.eps))
        assert r["bits"] == 1 + r["exponent_bits"] + r["mantissa_bits"]
    assert rows["float16"]["max"] == 65504 and rows["bfloat16"]["mantissa_bits"] == 7
    assert rows["float8_e4m3fn"]["max"] == 448 and rows["float8_e5m2"]["max"] == 57344
    assert rows["bfloat16"]["smallest_normal"] == rows["float32"]["smallest_normal"]


@pytest.mark.parametrize("fmt", ["float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_rounding_equals_jax_astype_bit_for_bit(fmt):
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(5000) * 10.0 ** rng.integers(-12, 6, 5000),
                        [0.0, -0.0, 1.0, 1 + 2**-8, 1 + 2**-7, 257.0, 2049.0, 65519.0, 65520.0]])
    x = x.astype(np.float32)
    ours = formats.round_to(x, fmt)
    ref = np.asarray(jnp.asarray(x).astype(formats.FORMATS[fmt]).astype(jnp.float32))
    np.testing.assert_array_equal(ours.view(np.uint32), ref.view(np.uint32))


def test_classify_into_normal_subnormal_flushed_overflow():
    x = np.array([0.0, 1.0, -3.0, 1e-6, 2e-7, 1e-9, -1e-10, 1e5, -7e4, 65504.0], np.float32)
    c = formats.classify(x, "float16")
    assert c == {"zero": 0.1, "normal": 0.3, "subnormal": 0.2, "flushed": 0.2, "overflow": 0.2}
    # bfloat16 has float32's range: nothing here underflows or overflows
    assert formats.classify(x, "bfloat16")["normal"] == 0.9


def test_exercise_5_numbers():
    assert formats.round_to(257.0, "bfloat16") == 256.0 and formats.round_to(258.0, "bfloat16") == 258.0
    assert formats.round_to(2049.0, "float16") == 2048.0
    assert formats.round_to(1 + 2**-8, "bfloat16") == 1.0  # halfway: ties to even
    assert formats.round_to(1 + 2**-7, "bfloat16") == 1 + 2**-7


def test_bf16_weight_swallows_a_small_update_that_master_weights_keep():
    w16 = jnp.bfloat16(1.0)
    assert w16 + jnp.bfloat16(1e-3) == w16  # the update is lost
    master = jnp.float32(1.0)
    for _ in range(10):
        master = master + jnp.float32(1e-3)
    assert master.astype(jnp.bfloat16) == jnp.bfloat16(1.0078125)  # ten kept updates show


@pytest.mark.slow
def test_fp32_policy_is_bit_identical_to_the_plain_step():
    graphdef, params, batches = setup()
    opt = optim.adam(3e-3)
    state, step = steplib.init_state(params, opt, P.policy("fp32")), steplib.make_step(graphdef, opt, P.policy("fp32"))
    plain, p, s = make_train_step(graphdef, opt), params, opt.init(params)
    for b in batches:
        state, _ = step(state, b)
        p, s, _ = plain(p, s, b)
    for a, c in zip(jax.tree.leaves(state.params), jax.tree.leaves(p)):
        np.testing.assert_array_equal(a, c)


@pytest.mark.slow
def test_mixed_precision_keeps_fp32_master_and_optimizer_state():
    graphdef, params, batches = setup()
    opt = optim.adam(3e-3)
    pol = P.policy("bf16")
    state, step = steplib.init_state(params, opt, pol), steplib.make_step(graphdef, opt, pol)
    for b in batches[:3]:
        state, m = step(state, b)
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(state.master)} == {jnp.dtype(jnp.float32)}
    assert {x.dtype for x in jax.tree.leaves(state.opt_state.mu)} == {jnp.dtype(jnp.float32)}
    for w, master in zip(jax.tree.leaves(state.params), jax.tree.leaves(state.master)):
        np.testing.assert_array_equal(w, master.astype(jnp.bfloat16))
    # fp32 master weights lose almost no update (measured 3e-5: fp32 has limits too)
    assert float(m["swallowed"]) < 1e-3


@pytest.mark.slow
def test_dynamic_loss_scaling_skips_on_overflow_and_grows_after_n_finite_steps():
    graphdef, params, batches = setup()
    opt = optim.adam(3e-3)
    pol = P.Policy("fp16-test", "float16", master_weights=True, loss_scale="dynamic",
                   initial_scale=2.0**10, growth_interval=3)
    step = steplib.make_step(graphdef, opt, pol)
    state = steplib.init_state(params, opt, pol)
    state, _ = step(state, batches[0])  # one normal step, so the optimizer state is non-trivial
    # an overflow for real: a scale of 2^40 pushes the fp16 gradients past 65504
    blown = state._replace(loss_scale=jnp.float32(2.0**40))
    after, m = step(blown, batches[1])
    assert not bool(m["finite"]) and int(after.skipped) == 1
    assert float(after.loss_scale) == 2.0**39
    for a, b in zip(jax.tree.leaves((after.params, after.master, after.opt_state)),
                    jax.tree.leaves((blown.params, blown.master, blown.opt_state))):
        np.testing.assert_array_equal(a, b)  # nothing moved, bit for bit
    scales = []
    state = state._replace(good_steps=jnp.int32(0))
    for b in batches[2:8]:
        state, m = step(state, b)
        assert bool(m["finite"])
        scales.append(float(state.loss_scale))
    assert scales == [2.0**10, 2.0**10, 2.0**11, 2.0**11, 2.0**11, 2.0**12]


@pytest.mark.slow
def test_pure_bf16_loses_small_updates():
    graphdef, params, batches = setup()
    opt = optim.sgd(1e-3)
    pol = P.policy("bf16-pure")
    state, step = steplib.init_state(params, opt, pol), steplib.make_step(graphdef, opt, pol)
    state, m = step(state, batches[0])
    assert float(m["swallowed"]) > 0.5  # most of a small SGD step vanishes in bf16 weights


@pytest.mark.parametrize("name, total", [("fp32", 16), ("bf16", 16), ("fp16", 16),
                                         ("bf16-pure", 8)])
def test_bytes_per_parameter_of_the_real_state(name, total):
    """Adam: fp32 4+4+8; mixed precision 2+2+4+4+4 = 16; pure bf16 2+2+2+2 = 8."""
    _, params, _ = setup()
    pol = P.policy(name)
    state = steplib.init_state(params, optim.adam(1e-3), pol)
    grads = jax.eval_shape(lambda p: p, state.params)  # gradients have the working params' dtype
    measured = steplib.state_bytes_per_param(state, grads, param_count(preset("tiny")))
    assert measured == pol.bytes_per_param()
    assert sum(measured.values()) == total


def test_unknown_policy_and_format():
    with pytest.raises(formats.PrecisionError, match="unknown precision policy 'fp4'.*bf16-pure, fp8"):
        P.policy("fp4")
    with pytest.raises(formats.PrecisionError, match="unknown format 'int4'"):
        formats.classify([1.0], "int4")
