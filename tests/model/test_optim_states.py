"""Optimizer states in bf16 (jaxscale.model.optim_states): what the state holds, how far
its updates land from fp32 moments', and checkpoints written before the option."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxscale.model import optim, precision
from jaxscale.model.optim_states import states_in
from jaxscale.parallel import step as steplib


def _tree():
    k = jax.random.split(jax.random.key(0), 2)
    return {"w": jax.random.normal(k[0], (64, 32)), "b": jax.random.normal(k[1], (32,))}


def test_the_moments_are_bf16_and_the_count_stays_an_integer():
    state = states_in("bf16", optim.adamw(1e-3)).init(_tree())
    dtypes = {str(x.dtype) for x in jax.tree.leaves(state)}
    assert dtypes == {"bfloat16", "int32"}
    assert states_in("fp32", optim.adamw(1e-3)) is not None  # fp32: the optimizer itself


def test_updates_follow_fp32_moments_within_bf16_rounding():
    """Ten AdamW steps on the same gradients: the bf16-moment updates stay within 2^-6 of
    the fp32-moment updates (relative to the largest), three bf16 roundings' worth; the
    first moment drifts from fp32's by at most its roundings carried forward: each step's
    half ulp (2^-9 relative) decays by b1 = 0.9 a step, sum_k 0.9^k 2^-9 over ten steps."""
    params, grads = _tree(), jax.tree.map(lambda x: 0.1 * jnp.sin(x), _tree())
    full, half = optim.adamw(1e-3), states_in("bf16", optim.adamw(1e-3))
    s32, s16 = full.init(params), half.init(params)
    for _ in range(10):
        u32, s32 = full.update(grads, s32, params)
        u16, s16 = half.update(grads, s16, params)
    for a, b in zip(jax.tree.leaves(u16), jax.tree.leaves(u32)):
        assert float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) <= 2 ** -6
    mu16, mu32 = s16.mu["w"].astype(jnp.float32), s32.mu["w"]
    carried = sum(0.9 ** k for k in range(10)) * 2 ** -9
    assert float(jnp.max(jnp.abs(mu16 - mu32) / jnp.abs(mu32))) <= carried
    assert float(jnp.max(jnp.abs(mu16 - mu32))) > 0  # it did round


def test_state_bytes_equal_the_closed_form():
    """bf16 working weights with an fp32 master: 2 + 2 + 4 + 2 x 2 = 12 bytes a parameter
    (16 with fp32 moments), measured from the state the step keeps."""
    params = _tree()
    n = sum(x.size for x in jax.tree.leaves(params))
    pol = precision.policy("bf16")
    for moments, optimizer_bytes in (("fp32", 8), ("bf16", 4)):
        state = steplib.init_state(params, states_in(moments, optax.adam(1e-3)), pol)
        grads = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
        measured = steplib.state_bytes_per_param(state, grads, n)
        closed = pol.bytes_per_param(moment_bytes=2 if moments == "bf16" else None)
        assert measured == closed and closed["optimizer"] == optimizer_bytes


def test_unknown_dtype_and_old_checkpoints():
    with pytest.raises(ValueError, match="fp16"):
        states_in("fp16", optim.adamw(1e-3))
    from jaxscale.training.checkpoint.store import CheckpointError, FORMAT, check_compatible
    from jaxscale.training.config import TrainConfig
    from dataclasses import asdict
    now = asdict(TrainConfig())
    old = {k: v for k, v in now.items() if k != "optimizer_state_dtype"}  # written before
    check_compatible({"format": FORMAT, "config": old}, now, False, "x")  # fp32: the same
    with pytest.raises(CheckpointError, match="optimizer_state_dtype"):
        check_compatible({"format": FORMAT, "config": old},
                         {**now, "optimizer_state_dtype": "bf16"}, False, "x")
    np.testing.assert_equal(TrainConfig().optimizer_state_dtype, "fp32")
    with pytest.raises(CheckpointError, match="optimizer_state_dtype='fp32'.*"
                                              "--optimizer-state-dtype fp32"):
        check_compatible({"format": FORMAT, "config": old},
                         {**now, "optimizer_state_dtype": "bf16"}, False, "x")


@pytest.mark.parametrize("optimizer", ["adam", "adam_l2", "adagrad"])
def test_state_too_slow_for_bf16_is_refused(optimizer):
    """Adam's default b2 = 0.999 moves the second moment by 0.1% a step, below bf16's 2^-8:
    after a spike it would never decay (measured: a gradient of 10 then 500 of 0.01 leave
    it at 0.1001 in bf16, 0.0607 in fp32). adamw trains with b2 = 0.95 here: allowed."""
    from jaxscale.training.config import TrainConfig, TrainConfigError
    with pytest.raises(TrainConfigError, match=f"bf16 with {optimizer}"):
        TrainConfig(optimizer=optimizer, optimizer_state_dtype="bf16").validate()
    TrainConfig(optimizer="adamw", optimizer_state_dtype="bf16").validate()
