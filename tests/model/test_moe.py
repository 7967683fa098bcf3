"""A mixture of experts in the one model: published parameter counts (total and active),
the router's losses at their closed forms, capacity and dropped tokens, equal experts as
one dense MLP, and the configurations refused by name."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxscale.model import config as model_config, moe, transformer as M
from jaxscale.model.config import ModelConfig, ModelConfigError

# Mistral's Mixtral 8x7B: 46.7B parameters in total (its safetensors index: 46,702,792,704),
# 12.9B used per token (two of eight experts)
MIXTRAL = {"total": 46_702_792_704, "active_billions": 12.9}


def test_mixtral_has_its_published_parameter_counts():
    cfg = model_config.preset("mixtral-8x7b")
    assert model_config.param_count(cfg) == MIXTRAL["total"]
    assert M.count_params(M.abstract(cfg)) == MIXTRAL["total"]  # the model as built
    assert round(model_config.param_count(cfg, active=True) / 1e9, 1) == MIXTRAL["active_billions"]


@pytest.mark.parametrize("change", [{}, dict(n_shared_experts=2, mlp="gelu", bias=True,
                                             moe_d_ff=48),
                                    dict(n_layers=4, moe_every=2, moe_d_ff=48, bias=True)],
                         ids=["tiny-moe", "shared-gelu", "interleaved"])
@pytest.mark.slow
def test_closed_form_counts_the_model_as_built(change):
    """Total: every tensor of the built model. Active: the total less the (E - k) experts a
    token does not use (each expert: d x f x 2 or 3 matrices, no biases)."""
    cfg = dataclasses.replace(model_config.preset("tiny-moe"), **change)
    built = M.count_params(M.build(cfg))
    assert model_config.param_count(cfg) == built
    per_expert = (3 if cfg.mlp == "swiglu" else 2) * cfg.d_model * cfg.expert_d_ff
    unused = cfg.moe_layers * (cfg.n_experts - cfg.top_k) * per_expert
    assert model_config.param_count(cfg, active=True) == built - unused


def _family(**kw):
    return dataclasses.replace(model_config.preset("tiny-moe").family, **kw)


def test_top_1_keeps_the_raw_probability():
    """Switch's gate: renormalised, a single expert's gate would be 1 and the loss would
    give the router no gradient."""
    logits = jnp.array([[2.0, 0.0, -1.0]])
    _, probs, gates, experts = moe.route(jnp.eye(3), logits, 1)
    assert int(experts[0, 0]) == 0 and float(gates[0, 0]) == float(probs[0, 0]) < 1
    _, _, two, _ = moe.route(jnp.eye(3), logits, 2)
    assert float(two.sum()) == pytest.approx(1.0)


def test_a_uniform_router_scores_the_closed_forms():
    """Zero router logits: every probability 1/E, so Switch's aux = E sum_i f_i / E = 1
    whatever the choices, and the z-loss is log(E)^2; nothing is dropped when dropless."""
    e, n = 8, 40
    logits, probs, gates, experts = moe.route(jnp.zeros((4, e)), jnp.ones((n, 4)), 2)
    _, kept = moe.assign(experts, e, moe.capacity(n, e, _family()))
    stats = moe.statistics(logits, probs, experts, kept, _family())
    assert float(stats["aux"]) == pytest.approx(1.0, abs=1e-6)
    assert float(stats["z"]) == pytest.approx(np.log(e) ** 2, rel=1e-6)
    assert float(stats["dropped"]) == 0.0 and bool(kept.all())


def test_capacity_keeps_first_choices_first_and_counts_the_dropped():
    """Every token wants experts 0 then 1; capacity 1.0 x 2 x 8 / 4 = 4 places each: expert
    0 takes the first four tokens' first choices, expert 1 the first four's second choices,
    the rest (8 of 16 assignments) are dropped and reported as 0.5."""
    n, e = 8, 4
    experts = jnp.tile(jnp.array([[0, 1]]), (n, 1))
    places = moe.capacity(n, e, _family(capacity_factor=1.0))
    place, kept = moe.assign(experts, e, places)
    assert places == 4 and kept[:4].all() and not kept[4:].any()
    assert np.array_equal(np.asarray(place[:4]), [[i, 4 + i] for i in range(4)])
    tokens = jnp.arange(1.0, n + 1)[:, None]  # token i carries i + 1
    expert_in = moe.dispatch(tokens, place, e, places)
    assert np.array_equal(np.asarray(expert_in[:2, :, 0]), [[1, 2, 3, 4], [1, 2, 3, 4]])
    assert float(expert_in[2:].sum()) == 0.0  # experts 2 and 3: nobody came
    back = moe.combine(expert_in, place, jnp.full((n, 2), 0.5))  # outputs = inputs
    assert np.array_equal(np.asarray(back[:, 0]), [1, 2, 3, 4, 0, 0, 0, 0])
    probs = jax.nn.one_hot(experts[:, 0], e)
    stats = moe.statistics(jnp.log(probs + 1e-9), probs, experts, kept, _family())
    assert float(stats["dropped"]) == 0.5
    assert float(stats["load_max"]) == e / 2  # two experts take every assignment


@pytest.mark.slow
def test_equal_experts_are_one_dense_mlp():
    """Dropless, with every expert the same MLP, the layer's output is that MLP's: the
    gates of a token's experts sum to 1 (max abs diff at fp32 rounding, <= 1e-6)."""
    cfg = model_config.preset("tiny-moe")
    p = jax.tree.map(lambda x: x[0], nnx.to_pure_dict(nnx.state(M.build(cfg), nnx.Param))
                     ["blocks"]["experts"])
    same = {k: jnp.broadcast_to(v[:1], v.shape) if k in ("w1", "w2", "w3") else v
            for k, v in p.items()}
    x = jax.random.normal(jax.random.key(0), (2, 16, cfg.d_model))
    y, stats = moe.layer(same, x, lambda v: v, cfg.family)
    dense = moe.mlp(x.reshape(32, -1), same["w1"][0], same["w2"][0], same["w3"][0], cfg.family)
    assert float(jnp.max(jnp.abs(y.reshape(32, -1) - dense))) <= 1e-6
    assert float(stats["dropped"]) == 0.0


def test_the_forward_reports_every_layers_router():
    cfg = model_config.preset("tiny-moe")
    logits, stats = M.build(cfg).with_stats(jnp.zeros((2, 16), jnp.int32))
    assert logits.shape == (2, 16, cfg.vocab_size)
    assert set(stats) == {"objective", "aux", "z", "dropped", "load_max"}
    w_aux, w_z = cfg.family.router_weights
    assert float(stats["objective"]) == pytest.approx(
        cfg.n_layers * (w_aux * float(stats["aux"]) + w_z * float(stats["z"])), rel=1e-5)
    _, dense = M.build(model_config.preset("tiny-llama")).with_stats(jnp.zeros((2, 16), jnp.int32))
    assert dense == {}


@pytest.mark.parametrize("change, words", [
    (dict(top_k=9), "top_k=9 experts per token out of n_experts=8; choose top_k from 1 to 8"),
    (dict(capacity_factor=0.0), "capacity_factor must be > 0"),
    (dict(capacity_factor=-1.0), "got -1.0"),
    (dict(n_experts=-2), "n_experts must be >= 0, got -2"),
    (dict(moe_every=3), r"moe_every=3 must divide n_layers=2 \(every n-th block holds the "
                        r"experts\); choose from \[1, 2\]"),
    (dict(moe_every=0), "moe_every=0 must divide"),
], ids=["top-k", "capacity-0", "capacity-negative", "experts-negative", "every-3", "every-0"])
def test_bad_expert_options_are_refused_by_name(change, words):
    with pytest.raises(ModelConfigError, match=words):
        dataclasses.replace(model_config.preset("tiny-moe"), **change)


def test_expert_options_on_a_dense_model_are_refused():
    with pytest.raises(ModelConfigError, match="top_k=1, capacity_factor=1.25 configure "
                                               "experts, but the model has none"):
        ModelConfig(vocab_size=8, seq_len=8, d_model=8, n_layers=1, n_heads=2, d_ff=8,
                    top_k=1, capacity_factor=1.25)
    with pytest.raises(ModelConfigError, match="moe_every=2 configure experts"):
        ModelConfig(vocab_size=8, seq_len=8, d_model=8, n_layers=2, n_heads=2, d_ff=8,
                    moe_every=2)


@pytest.mark.slow
def test_interleaved_experts_are_every_n_th_block_of_a_loop():
    """moe_every=2 on 4 blocks: blocks 2 and 4 route to experts, 1 and 3 run the dense
    MLP. The scanned forward (groups of two blocks per loop step) against the blocks
    called one by one in a Python loop, each with its own slices: logits within 1e-6
    (fp32; the same products, fused differently: measured 6e-8). The statistics are the
    two expert blocks' (their objectives summed)."""
    from jaxscale.model import block as B
    cfg = dataclasses.replace(model_config.preset("tiny-moe"), n_layers=4, moe_every=2)
    model = M.build(cfg)
    p = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    blocks = p["blocks"]
    assert blocks["w1"].shape[0] == 2 and blocks["experts"]["w1"].shape[0] == 2
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, cfg.vocab_size)
    logits, stats = model.with_stats(tokens)
    x, objective = M.embed(p, tokens, None, cfg.family), 0.0
    for i in range(4):
        mine = {k: jax.tree.map(lambda a: a[i], v) for k, v in blocks.items()
                if k not in ("w1", "w2", "w3", "experts")}
        if i % 2:  # the second of each pair
            mine["experts"] = jax.tree.map(lambda a: a[i // 2], blocks["experts"])
        else:
            mine.update({k: blocks[k][i // 2] for k in ("w1", "w2", "w3")})
        x, s = B.block_with_stats(mine, x, family=cfg.family)
        assert bool(s) == bool(i % 2)
        objective += float(s.get("objective", 0.0))
    np.testing.assert_allclose(M.head(p, x, cfg.family), logits, atol=1e-6, rtol=0)
    assert float(stats["objective"]) == pytest.approx(objective, rel=1e-6)


MIXTRAL_JSON = {  # Mistral's config.json for Mixtral 8x7B v0.1, as its repository ships it
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
    "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0", "use_cache": True, "vocab_size": 32000}


def test_a_mixtral_config_json_is_the_preset(tmp_path):
    """Read offline: the preset's shape (its context is the file's 32,768), the published
    count, and Mixtral's router: coefficient 0.02 over all layers at once = 0.02 x 2 / 32 a
    layer here (hf_config), no z-loss."""
    import json
    path = tmp_path / "config.json"
    path.write_text(json.dumps(MIXTRAL_JSON))
    cfg = model_config.preset(str(path))
    assert cfg == dataclasses.replace(model_config.preset("mixtral-8x7b"), seq_len=32768)
    assert (cfg.router_aux_weight, cfg.router_z_weight) == (0.02 * 2 / 32, 0.0)
    assert model_config.param_count(cfg) == MIXTRAL["total"]
    path.write_text(json.dumps({**MIXTRAL_JSON, "sliding_window": 4096}))
    with pytest.raises(ModelConfigError, match="sliding_window 4096 is not computed by jaxscale"):
        model_config.preset(str(path))
