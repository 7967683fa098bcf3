"""Model FLOPs (jaxscale.model.flops) and peak FLOP/s (jaxscale.measure.hardware): formulas against a hand
count and XLA, the datasheet lookup, and the matmul benchmark's accounting."""
import math

import jax
import jax.numpy as jnp
import pytest

from jaxscale.model import flops as F
from jaxscale.measure import hardware as H
from jaxscale.model import config as model_config


# --- model FLOPs -----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["tiny", "small", "tiny-llama", "tiny-moe", "tiny-deepseek"])
def test_formula_matches_the_hand_count_of_every_matmul(name):
    cfg = model_config.preset(name)
    for batch, seq in [(1, cfg.seq_len), (4, cfg.seq_len), (3, 16)]:
        tokens = batch * seq
        forward = F.hand_count(cfg, batch, seq)
        assert 3 * forward % tokens == 0
        assert 3 * forward // tokens == F.model_flops_per_token(cfg, seq).total


def test_flop_count_fields_for_tiny():
    cfg = model_config.preset("tiny")  # d=32, L=2, f=128, V=101, s=64
    c = F.model_flops_per_token(cfg)
    d, L, f, v, s = cfg.d_model, cfg.n_layers, cfg.d_ff, cfg.vocab_size, cfg.seq_len
    assert c.matmul_params == L * (4 * d * d + 2 * d * f) + v * d
    # N is the parameter count less embeddings' position table, biases and norms
    assert c.matmul_params == model_config.param_count(cfg) - s * d - L * (9 * d + f) - 2 * d
    assert c.dense == 6 * c.matmul_params
    assert c.attention == 12 * L * s * d == 2 * c.attention_causal
    assert c.total == c.dense + c.attention and c.total_causal == c.dense + c.attention_causal
    assert F.model_flops_per_token(cfg, seq_len=32).attention == c.attention // 2
    as_dict = c.as_dict()
    assert as_dict["total"] == c.total and as_dict["convention"] == F.CONVENTION
    assert "\n" not in F.CONVENTION


def test_recompute_flops_per_remat_policy():
    cfg = model_config.preset("small")
    c = F.model_flops_per_token(cfg)
    blocks = 6 * F.block_matmul_params(cfg) + c.attention  # training FLOPs of the blocks
    assert F.recompute_flops_per_token(cfg, "none") == 0
    assert F.recompute_flops_per_token(cfg, "matmuls") == 0
    assert F.recompute_flops_per_token(cfg, "full") * 3 == blocks  # one more forward
    with pytest.raises(ValueError, match="none, full, matmuls"):
        F.recompute_flops_per_token(cfg, "some")


# --- XLA's count and its blind spots -----------------------------------------------------

N, STEPS = 64, 8
TRUE = STEPS * 2 * N ** 3  # 4,194,304


def _scanned(unroll):
    def f(x, ws):
        return jax.lax.scan(lambda c, w: (c @ w, None), x, ws, unroll=unroll)[0]
    return jax.jit(f).lower(jnp.ones((N, N)), jnp.ones((STEPS, N, N))).compile()


def test_xla_counts_a_scan_body_once_unless_unrolled():
    # Measured (jax 0.10.2, CPU): 524,290 rolled = one matmul + 2 FLOPs of loop counter,
    # 4,194,304 unrolled. rel=1e-3 leaves room for a few such scalar ops, nothing more.
    assert F.xla_flops(_scanned(1)) == pytest.approx(TRUE / STEPS, rel=1e-3)
    assert F.xla_flops(_scanned(True)) == pytest.approx(TRUE, rel=1e-3)


def test_xla_counts_custom_calls_as_nothing():
    n = 64
    chol = jax.jit(jnp.linalg.cholesky).lower(2 * jnp.eye(n)).compile()
    assert "custom-call" in chol.as_text()
    # LAPACK's potrf does ~n^3/3 = 87k FLOPs; XLA sees only the elementwise ops around it
    # (20,480 = 5 per element measured), so allow 10 per element and no more.
    assert F.xla_flops(chol) <= 10 * n * n < n ** 3 / 3

    def host(a):
        return jax.pure_callback(lambda b: b @ b, jax.ShapeDtypeStruct(a.shape, a.dtype), a)
    only_callback = jax.jit(host).lower(jnp.eye(n)).compile()
    assert only_callback.cost_analysis()["flops"] == -1  # "unknown"
    assert F.xla_flops(only_callback) is None


class _Cost:
    def __init__(self, cost):
        self.cost = cost

    def cost_analysis(self):
        return self.cost


def test_xla_flops_reads_dict_list_and_missing():
    assert F.xla_flops(_Cost({"flops": 12.0})) == 12.0
    assert F.xla_flops(_Cost([{"flops": 7.0}])) == 7.0
    assert F.xla_flops(_Cost({"bytes accessed": 1.0})) is None
    assert F.xla_flops(_Cost([])) is None and F.xla_flops(_Cost(None)) is None


# --- peak FLOP/s -------------------------------------------------------------------------

@pytest.mark.parametrize("kind, key", [
    ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA H100 NVL", "h100-nvl"), ("NVIDIA H200", "h200-sxm"),
    ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA A100-SXM4-40GB", "a100"),
    ("NVIDIA A100 80GB PCIe", "a100"), ("NVIDIA A10G", "a10"), ("NVIDIA A10", "a10"),
    ("NVIDIA L4", "l4"), ("Tesla V100-SXM2-16GB", "v100-sxm2"),
    ("Tesla V100-PCIE-32GB", "v100-pcie"), ("TPU v4", "tpu-v4"),
    ("TPU v5 lite", "tpu-v5e"), ("TPU v5e", "tpu-v5e"), ("TPU v5p", "tpu-v5p"),
    ("TPU v5", "tpu-v5p"), ("TPU v6 lite", "tpu-v6e"),
    ("cpu", None), ("NVIDIA GeForce RTX 4090", None), ("TPU v7x", None),
])
def test_device_kinds_map_to_datasheet_entries(kind, key):
    assert H.device_key(kind) == key


def test_datasheet_peaks():
    assert H.datasheet_peak("NVIDIA H200", "bfloat16") == 989e12
    assert H.datasheet_peak("NVIDIA H100 80GB HBM3", jnp.bfloat16) == 989e12
    assert H.datasheet_peak("NVIDIA H100 PCIe", "bfloat16") == 756e12
    assert H.datasheet_peak("NVIDIA A100-SXM4-40GB", jnp.float32) == 19.5e12
    assert H.datasheet_peak("NVIDIA A100-SXM4-40GB", "tfloat32") == 156e12
    assert H.datasheet_peak("Tesla V100-SXM2-16GB", "float16") == 125e12
    assert H.datasheet_peak("TPU v6 lite", "bfloat16") == 918e12
    # no guessing: unknown devices, and dtypes a chip has no figure for
    assert H.datasheet_peak("cpu", "float32") is None
    assert H.datasheet_peak("Mystery Accelerator 9000", "bfloat16") is None
    assert H.datasheet_peak("Tesla V100-SXM2-16GB", "bfloat16") is None
    assert H.datasheet_peak("TPU v4", "float16") is None


@pytest.mark.parametrize("bad", ["int8", "fp16", jnp.int32])
def test_unknown_dtype_names_the_choices(bad):
    with pytest.raises(ValueError, match="bfloat16, float16, float32, tfloat32"):
        H.datasheet_peak("NVIDIA H200", bad)


def test_mfu_arithmetic():
    # 1B-ish model: 6e9 FLOPs/token at 40,000 tokens/s on a 989 TFLOP/s chip
    assert H.mfu(6e9, 40_000, 989e12) == pytest.approx(6e9 * 4e4 / 989e12)
    assert H.mfu(1e9, 100.0, 1e12) == pytest.approx(0.1)
    assert H.mfu(1e9, 100.0, None) is None


def test_measured_matmul_peak_on_cpu():
    device = jax.devices()[0]
    p = H.measure_matmul_peak(device, n=128, iters=2, repeats=3)
    assert math.isfinite(p.flops_per_s) and p.flops_per_s > 0
    assert (p.n, p.iters, p.dtype, p.platform) == (128, 2, "float32", "cpu")
    assert p.flops_per_s * p.seconds == pytest.approx(2 * 2 * 128 ** 3, rel=1e-9)
    assert p.as_dict()["device_kind"] == device.device_kind
