"""The tpu-flash attention kernel (Pallas's TPU flash attention) against the einsum reference,
run on this CPU under Pallas's TPU interpreter: the same kernel code, blocks and all, only
not on a chip. Bounds measured here in fp32 on unit-normal inputs: the output within 4e-7
and the gradients within 5e-6 of the reference at T = 128 (the kernel's blocked online
softmax sums in another order); 1e-5 leaves room for other inputs of that size."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jaxscale.model import attention as A
from jaxscale.parallel.plan import Plan, PlanError

BOUND = 1e-5


def _inputs(t=128, heads=4, kv_heads=4, d=16, b=2):
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(kq, (b, t, heads, d)), jax.random.normal(kk, (b, t, kv_heads, d)),
            jax.random.normal(kv, (b, t, kv_heads, d)))


def _loss(kernel, segments=None):
    return lambda q, k, v: (A.attend(q, k, v, kernel, segments) ** 2).sum()


@pytest.mark.parametrize("t, kv_heads, documents", [
    (128, 4, False),  # one block
    (256, 2, False),  # two blocks, grouped-query attention (k, v repeated to 4 heads)
    (128, 4, True),  # attention kept inside documents
])
@pytest.mark.slow
def test_tpu_flash_equals_the_reference_in_value_and_gradient(t, kv_heads, documents):
    q, k, v = _inputs(t, kv_heads=kv_heads)
    segments = (jnp.arange(t)[None, :] >= t // 3).astype(jnp.int32).repeat(2, 0) \
        if documents else None
    ref = A.attend(q, k, v, "einsum", segments)
    ref_grads = jax.grad(_loss("einsum", segments), argnums=(0, 1, 2))(q, k, v)
    with pltpu.force_tpu_interpret_mode():
        out = jax.jit(lambda q, k, v: A.attend(q, k, v, "tpu-flash", segments))(q, k, v)
        grads = jax.jit(jax.grad(_loss("tpu-flash", segments), argnums=(0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(out, ref, atol=BOUND, rtol=0)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, atol=BOUND * float(jnp.abs(r).max()), rtol=0)


def test_tpu_flash_says_what_it_needs():
    with pytest.raises(A.KernelError, match="multiple of 128 tokens"):
        A.attend(*_inputs(t=200), "tpu-flash")
    with pytest.raises(A.KernelError, match="got 64"):  # its backward works in whole blocks
        A.attend(*_inputs(t=64), "tpu-flash")
    with pytest.raises(A.KernelError, match="tpu-flash is Pallas's TPU kernel; these devices are cpu"):
        A.check_kernel("tpu-flash", "cpu")
    A.check_kernel("tpu-flash", "tpu")
    assert Plan(attention="tpu-flash").validate().attention == "tpu-flash"
    with pytest.raises(PlanError, match="unknown attention kernel 'flash'"):
        Plan(attention="flash").validate()


@pytest.mark.parametrize("layout", ["dp=2", "tp=2"])
@pytest.mark.slow
def test_a_sharded_step_with_tpu_flash_has_the_reference_gradient(layout, monkeypatch):
    """Inside shard_map the kernel's outputs are marked varying over its inputs' axes, and
    its own backward keeps those marks from being transposed into psums: one step's whole
    gradient under dp=2 (each device its rows) and tp=2 (each device its heads), the
    kernel interpreted, equals one device's with the einsum reference (bound as above,
    relative to the largest entry). The step builder refuses tpu-flash on CPU devices; for
    the interpreter it is let through."""
    import dataclasses

    from flax import nnx

    from conftest import KEEP_GRADIENT
    from jaxscale.model import config as model_config, transformer as modellib
    from jaxscale.parallel.build import build_train_step

    cfg = dataclasses.replace(model_config.preset("tiny"), seq_len=128)
    params = nnx.to_pure_dict(nnx.state(modellib.build(cfg, seed=0), nnx.Param))
    tokens = jax.random.randint(jax.random.key(1), (4, 129), 0, cfg.vocab_size)
    batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:],
             "mask": jnp.ones((4, 128), jnp.float32)}

    def gradient(plan):
        init, step = build_train_step(cfg, plan, KEEP_GRADIENT, jax.devices()[:plan.n_devices])
        state, metrics = step(init(params), step.place_batch(batch))
        whole = step.full_params(state._replace(params=state.opt_state[0].trace))
        return jax.tree.map(np.asarray, whole), float(metrics["loss"])

    ref, ref_loss = gradient(Plan())
    monkeypatch.setattr(A, "check_kernel", lambda *args, **kwargs: None)
    with pltpu.force_tpu_interpret_mode():
        got, loss = gradient(Plan.parse(f"{layout},attention=tpu-flash"))
    assert loss == pytest.approx(ref_loss, rel=BOUND)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(ref)):
        # (+1e-9: the keys' bias, whose gradient is zero but for rounding, about 1e-12)
        np.testing.assert_allclose(g, r, atol=BOUND * float(np.abs(r).max()) + 1e-9, rtol=0,
                                   err_msg=jax.tree_util.keystr(path))
