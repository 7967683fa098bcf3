"""Multi-head latent attention and DeepSeek's shapes (jaxscale.model.mla): the layer against
its absorbed form (what inference computes from the cached latent), the fused kernel's
padded values, the published parameter counts, the cost model's count and FLOPs against
the model's, and the dense first blocks of the stack."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxscale.cli import calculator_args
from jaxscale.costmodel import steptime
from jaxscale.model import config as model_config, flops, mla, stack
from jaxscale.model import transformer as modellib
from jaxscale.model.config import ModelConfig, ModelConfigError


def _layer0(q_lora_rank: int = 16):
    """Block 0 of tiny-deepseek (q_lora_rank 0: queries straight from x, V2-Lite's way),
    its latent norms' scales drawn at random (at init they are ones, which would hide
    where each scale applies), and an input x."""
    cfg = dataclasses.replace(model_config.preset("tiny-deepseek"), q_lora_rank=q_lora_rank)
    blocks = nnx.to_pure_dict(nnx.state(modellib.build(cfg).blocks, nnx.Param))
    p = jax.tree.map(lambda a: np.asarray(a[0]), blocks)
    for i, norm in enumerate(("q_norm", "kv_norm")):
        if norm in p[mla.LATENT]:
            scale = p[mla.LATENT][norm]["scale"]
            p[mla.LATENT][norm]["scale"] = np.asarray(
                jax.random.uniform(jax.random.key(7 + i), scale.shape, minval=0.5, maxval=1.5))
    x = jax.random.normal(jax.random.key(1), (2, 16, cfg.d_model), jnp.float32)
    return cfg, p, x


def _rms(c, scale, eps):
    return c / np.sqrt(np.mean(c ** 2, -1, keepdims=True) + eps) * scale


def _turn(t, theta):
    """RoPE in float64 on [B, T, heads, width]: pair i of the two halves turns by
    position / theta^(2i / width) (model.rope's convention, written out again)."""
    half = t.shape[-1] // 2
    angles = np.arange(t.shape[1])[:, None] / theta ** (np.arange(half) * 2 / t.shape[-1])
    cos, sin = np.cos(angles)[None, :, None], np.sin(angles)[None, :, None]
    a, b = t[..., :half], t[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)


def _absorbed(p, wo, x, cfg):
    """The same attention in float64, every step written out again, and keys never built
    per head: each head's query is taken into the latent space (q_nope W_kb^T), scored
    against the cached latent c_kv and the shared rotated key, and the weighted latent is
    expanded by W_vb only at the end (what inference computes from its cache)."""
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    lat, x = {k: jax.tree.map(f64, v) for k, v in p[mla.LATENT].items()}, f64(x)
    nope, ck, eps = cfg.qk_nope_dim, cfg.kv_lora_rank, cfg.norm_eps
    if "wq" in lat:
        q = np.einsum("btd,dhk->bthk", x, lat["wq"])
    else:
        q = np.einsum("btr,rhk->bthk", _rms(x @ lat["wq_a"], lat["q_norm"]["scale"], eps),
                      lat["wq_b"])
    q_rope = _turn(q[..., nope:], cfg.rope_theta)
    latent = x @ lat["wkv_a"]
    c = _rms(latent[..., :ck], lat["kv_norm"]["scale"], eps)
    k_rope = _turn(latent[..., None, ck:], cfg.rope_theta)[:, :, 0]
    q_latent = np.einsum("bthk,rhk->bthr", q[..., :nope], lat["wk_b"])
    scores = (np.einsum("bthr,bsr->bhts", q_latent, c)
              + np.einsum("bthk,bsk->bhts", q_rope, k_rope)) / math.sqrt(cfg.qk_dim)
    t = x.shape[1]
    scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    context = np.einsum("bhts,bsr->bthr", w, c)  # the weighted latent, per head
    return np.einsum("bthr,rhv,hvd->btd", context, lat["wv_b"], f64(wo))


@pytest.mark.parametrize("q_lora_rank", [16, 0], ids=["q-latent", "q-from-x"])
@pytest.mark.slow
def test_latent_attention_equals_its_absorbed_form(q_lora_rank):
    """The layer builds every head's k and v; its absorbed form never does. Equal within
    2e-6 of the output's largest entry (fp32 against fp64, three matmuls deep; measured
    2.1e-7)."""
    cfg, p, x = _layer0(q_lora_rank)
    ours = mla.attention(p[mla.LATENT], p["wo"], x, jnp.arange(x.shape[1]), lambda y: y,
                         family=cfg.family)
    want = _absorbed(p, p["wo"], x, cfg)
    assert np.abs(np.asarray(ours, np.float64) - want).max() <= 2e-6 * np.abs(want).max()


@pytest.mark.slow
def test_the_fused_kernel_takes_values_padded_to_the_keys_width():
    """xla's kernel needs v as wide as k: padded with zeros, the output equals einsum's
    within 1e-6 of its largest entry (the two kernels' sums run in other orders)."""
    cfg, p, x = _layer0()
    run = lambda kernel: mla.attention(p[mla.LATENT], p["wo"], x, jnp.arange(16),  # noqa: E731
                                       lambda y: y, kernel, family=cfg.family)
    einsum, xla = np.asarray(run("einsum")), np.asarray(run("xla"))
    assert np.abs(einsum - xla).max() <= 1e-6 * np.abs(einsum).max()


def test_deepseek_counts_are_the_published_ones():
    """DeepSeek-V3: 671B parameters (the paper and model card, the multi-token-prediction
    module apart), 37B active; V2-Lite: 15.7B. The closed form equals the built model's
    count exactly; the active count is the paper's without the input embedding (a lookup,
    no matmul): 36.63B -> 37B (with it, 37.55B)."""
    v3 = model_config.preset("deepseek-v3")
    total = model_config.param_count(v3)
    assert total == modellib.count_params(modellib.abstract(v3)) == 671_026_404_352
    assert round(total / 1e9) == 671
    assert round((model_config.param_count(v3, active=True) - v3.vocab_size * v3.d_model)
                 / 1e9) == 37
    lite = model_config.preset("deepseek-v2-lite")
    assert model_config.param_count(lite) == modellib.count_params(modellib.abstract(lite))
    assert round(model_config.param_count(lite) / 1e8) == 157


@pytest.mark.parametrize("name", ["tiny-deepseek", "deepseek-v2-lite", "deepseek-v3"])
def test_the_cost_model_reads_the_latent_shape(name):
    """The calculators' shape (costmodel.shape) of a DeepSeek preset: its matmul weights
    are the model's count less the norms' scales (2 per block and the final one, plus the
    two latent norms per block), its model FLOPs per token those of model.flops."""
    cfg = model_config.preset(name)
    fields = dict.fromkeys(("layers", "hidden", "heads", "ffn", "kv_heads", "vocab", "seq"))
    args = type("Args", (), dict(model=name, swiglu=False, **fields))()
    shape = calculator_args.transformer(calculator_args.model_shape(args, 2048))
    norms = cfg.n_layers * (2 * cfg.d_model + cfg.q_lora_rank + cfg.kv_lora_rank) + cfg.d_model
    assert shape.params() == model_config.param_count(cfg) - norms
    assert steptime.flops_per_token(shape)["model"] == flops.model_flops_per_token(cfg).total


@pytest.mark.slow
def test_the_dense_first_blocks_scan_apart_and_cut():
    """tiny-deepseek's first block keeps the dense MLP (stack.DENSE), the other two hold the
    experts: the scan runs the two runs in order, and a cut after 1 or 2 blocks is the
    parameters of the model of those blocks (a plain dense model inside the dense ones):
    compare's divergence search builds and runs each cut."""
    cfg = model_config.preset("tiny-deepseek")
    blocks = nnx.to_pure_dict(nnx.state(modellib.build(cfg).blocks, nnx.Param))
    assert blocks[stack.DENSE]["w1"].shape[0] == 1 and blocks["experts"]["router"].shape[0] == 2
    first, rest = stack.runs(blocks)
    assert "experts" not in first and first["ln1"]["scale"].shape[0] == 1
    assert "w1" not in rest and rest["ln1"]["scale"].shape[0] == 2
    one, two = stack.first(blocks, 1), stack.first(blocks, 2)
    assert stack.DENSE not in one and "experts" not in one and one["w1"].shape[0] == 1
    assert two["experts"]["router"].shape[0] == 1 and two["ln1"]["scale"].shape[0] == 2
    for n, cut in ((1, one), (2, two)):  # each cut is the parameters of first_blocks(n)
        model = nnx.to_pure_dict(nnx.state(modellib.build(cfg.first_blocks(n)).blocks, nnx.Param))
        assert jax.tree.map(np.shape, model) == jax.tree.map(np.shape, cut)
    seen = []
    stack.scan(lambda h, p: (seen.append("experts" in p) or h, {}), jnp.zeros(()), blocks)
    assert seen == [False, True]  # each run's body traced once: dense, then experts


@pytest.mark.parametrize("change, words", [
    (dict(kv_lora_rank=16, qk_rope_dim=4, v_head_dim=8), "needs position 'rope'"),
    (dict(qk_rope_dim=4), "configure latent attention; set kv_lora_rank > 0"),
    (dict(n_experts=4, first_dense=2), "first_dense=2 dense blocks must leave experts"),
    (dict(first_dense=1), "first_dense=1 configure experts, but the model has none"),
], ids=["learned-positions", "no-latent", "all-dense", "no-experts"])
def test_bad_latent_and_dense_options_are_named(change, words):
    with pytest.raises(ModelConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig(vocab_size=8, seq_len=8, d_model=8, n_layers=2, n_heads=2, d_ff=8,
                    **change)
