"""On an NVIDIA GPU: cuDNN flash attention against the einsum reference, and the commands
with --platform gpu. Skipped on CPU (see conftest: JAXSCALE_GPU_TESTS=1 runs them); never
run in this project's CI, which has no GPU: benchmarks/gpu_check.sh runs them."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxscale.model import attention
from jaxscale import bench
from jaxscale.measure import hardware

pytestmark = pytest.mark.gpu


def _gpu():
    return jax.devices("gpu")[0]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_cudnn_flash_attention_equals_the_einsum_reference(dtype):
    """Forward and gradients of q, k, v, in 16-bit, against the einsum reference computed
    in fp32 from the same 16-bit inputs. Bound 2e-2 of each output's scale: bf16 keeps 8
    bits of mantissa (2^-8 = 0.4% per rounding), and the kernels round in other places."""
    keys = jax.random.split(jax.random.key(0), 4)
    shape = (2, 512, 4, 64)
    q, k, v, dy = (jax.device_put(jax.random.normal(kk, shape, dtype), _gpu()) for kk in keys)

    def cudnn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    def ref(q, k, v):
        return attention.causal_attention(*(x.astype(jnp.float32) for x in (q, k, v)))
    out, vjp = jax.vjp(cudnn, q, k, v)
    ref_out, ref_vjp = jax.vjp(ref, q, k, v)
    for a, b in zip((out, *vjp(dy)), (ref_out, *ref_vjp(dy.astype(jnp.float32)))):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.abs(a - b).max() <= 2e-2 * np.abs(b).max()


def test_a_bf16_step_with_cudnn_attention_has_the_reference_loss():
    """One small-model step in bf16 on the GPU, cuDNN attention against einsum: the same
    loss within bf16 rounding (1e-2 relative)."""
    from conftest import setup
    from jaxscale.parallel.plan import Plan
    from jaxscale.parallel.build import build_train_step
    from jaxscale.training.config import make_optimizer
    cfg, params, batch = setup("small")
    losses = {}
    for kernel in ("einsum", "cudnn"):
        init, step = build_train_step(cfg, Plan(precision="bf16", attention=kernel),
                                      make_optimizer("adamw", 1e-3), [_gpu()])
        state = init(jax.device_put(params, _gpu()))
        _, metrics = step(state, jax.device_put(batch, _gpu()))
        losses[kernel] = float(metrics["loss"])
    assert losses["cudnn"] == pytest.approx(losses["einsum"], rel=1e-2)


def test_bench_reports_mfu_against_the_datasheet():
    dev = _gpu()
    peak = hardware.measure_matmul_peak(dev)
    r = bench.run(bench.BenchConfig("small", 16, "bf16", attention="cudnn", steps=3), dev, peak)
    assert r.datasheet_peak is not None, f"no datasheet entry for {dev.device_kind!r}"
    assert 0 < r.mfu_datasheet < 1 and 0 < r.mfu_matmul < 1.2
    assert r.allocator_peak_bytes is not None and r.allocator_peak_bytes > 0
    assert r.memory["temporaries"] > 0
