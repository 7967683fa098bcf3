"""The Llama family in the one model: published parameter counts, RoPE's relative positions,
grouped-query attention against multi-head attention, Hugging Face config.json files, and
the layouts that split (or cannot split) the k/v heads, against the single device."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxscale.measure import compare_trees
from jaxscale.model import config as model_config, rope, transformer as M
from jaxscale.model.config import ModelConfig, ModelConfigError
from jaxscale.training.config import TrainConfig
from jaxscale.training.loop import train

from conftest import canonical_after_two_steps, fp32_sum_bound, one_step, setup

# Meta's model cards and the configs' safetensors indexes (total parameters)
PUBLISHED = {"llama2-7b": 6_738_415_616, "llama2-70b": 68_976_648_192,
             "llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496,
             "llama3-405b": 405_853_388_800}


@pytest.mark.parametrize("name", PUBLISHED)
def test_presets_have_the_published_parameter_counts(name):
    cfg = model_config.preset(name)
    assert model_config.param_count(cfg) == PUBLISHED[name]
    assert M.count_params(M.abstract(cfg)) == PUBLISHED[name]  # the model as built


def test_garden_llamas_are_the_llama_family():
    for name in ("tiny-llama", "small-llama"):
        cfg = model_config.preset(name)
        assert (cfg.norm, cfg.mlp, cfg.position, cfg.tied_head, cfg.bias) == (
            "rmsnorm", "swiglu", "rope", False, False)
        assert cfg.kv_heads < cfg.n_heads and name in model_config.CPU_PRESETS
        params = nnx.to_pure_dict(nnx.state(M.abstract(cfg), nnx.Param))
        assert "pos_embed" not in params and "unembed" in params and "w3" in params["blocks"]
        assert not {"bq", "bk", "bv", "bo", "b1", "b2"} & set(params["blocks"])
        assert params["blocks"]["wk"].shape[2] == cfg.kv_heads


def test_rope_scores_depend_only_on_the_distance():
    """<R(m) q, R(n) k> = <R(m + s) q, R(n + s) k> for every shift s; lengths are kept.
    Tolerance 2e-5 relative: float32 angles m w at positions up to ~600 and the rotation's
    own rounding (measured below 3e-6)."""
    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.normal(size=(1, 40, 2, 16)), jnp.float32) for _ in range(2))
    pos = jnp.arange(40)

    def scores(shift):
        a, b = rope.rotate(q, pos + shift, 1e4), rope.rotate(k, pos + shift, 1e4)
        return jnp.einsum("bqhk,bshk->bhqs", a, b)
    base = scores(0)
    for shift in (1, 17, 555):
        assert float(jnp.max(jnp.abs(scores(shift) - base))) <= 2e-5 * float(jnp.max(jnp.abs(base)))
    rotated = rope.rotate(q, pos + 3, 1e4)
    np.testing.assert_allclose(jnp.linalg.norm(rotated, axis=-1), jnp.linalg.norm(q, axis=-1),
                               rtol=1e-6)
    unrotated = jnp.einsum("bqhk,bshk->bhqs", q, k)  # position 0 turns nothing
    assert float(jnp.max(jnp.abs(unrotated - jnp.einsum(
        "bqhk,bshk->bhqs", rope.rotate(q, 0 * pos, 1e4), rope.rotate(k, 0 * pos, 1e4))))) == 0.0


def test_llama3_scaling_keeps_fast_pairs_and_slows_slow_ones():
    """Llama 3.1's rope_scaling (factor 8, low 1, high 4, original 8,192): pairs whose
    wavelength is under 8192 / 4 keep their frequency, pairs over 8192 / 1 turn 8x slower,
    the band between lies between the two."""
    plain = rope.frequencies(128, 5e5)
    scaled = rope.frequencies(128, 5e5, (8.0, 1.0, 4.0, 8192.0))
    wavelength = 2 * np.pi / plain.astype(np.float64)
    fast, slow = wavelength < 8192 / 4, wavelength > 8192
    assert fast.sum() and slow.sum() and (~fast & ~slow).sum()
    assert np.array_equal(scaled[fast], plain[fast])
    np.testing.assert_allclose(scaled[slow], plain[slow] / 8, rtol=1e-6)
    mid = ~fast & ~slow
    assert np.all(scaled[mid] < plain[mid]) and np.all(scaled[mid] > plain[mid] / 8)


def test_grouped_query_attention_is_multi_head_with_repeated_kv_heads():
    """tiny-llama (4 query heads, 2 k/v heads) against the same model with 4 k/v heads whose
    weights repeat each of its 2 (head j reads k/v head j // 2): the same logits up to the
    matmul's rounding. The products are the same, but XLA's x @ Wk over 2 heads and over 4
    blocks its sums differently: measured 8.9e-8 absolute on logits of order 0.1-1, a few
    float32 ulps; bound 1e-6 of the largest logit."""
    cfg = model_config.preset("tiny-llama")
    mha = dataclasses.replace(cfg, n_kv_heads=0)
    params = nnx.to_pure_dict(nnx.state(M.build(cfg), nnx.Param))
    group = cfg.n_heads // cfg.kv_heads
    repeated = {**params, "blocks": {**params["blocks"], **{
        w: jnp.repeat(params["blocks"][w], group, axis=2) for w in ("wk", "wv")}}}
    tokens = jnp.asarray(setup("tiny-llama")[2]["tokens"][:4])
    gqa = M.forward(params, tokens, family=cfg.family)
    full = M.forward(repeated, tokens, family=mha.family)
    assert float(jnp.max(jnp.abs(gqa - full))) <= 1e-6 * float(jnp.max(jnp.abs(full)))


def test_forgetting_the_family_fails_loudly():
    cfg = model_config.preset("tiny-llama")
    params = nnx.to_pure_dict(nnx.state(M.build(cfg), nnx.Param))
    with pytest.raises(ModelConfigError, match="pass the model's family"):
        M.forward(params, jnp.zeros((1, 8), jnp.int32))  # GPT-2's family: learned positions


@pytest.mark.parametrize("plan", [dict(tp=4), dict(tp=2), dict(cp=2), dict(dp=2, tp=2, zero_stage=3),
                                  dict(tp=4, sequence_parallel=True)],
                         ids=["tp4-kv-whole", "tp2-kv-split", "cp2-rope-ring", "fsdp-tp2",
                              "tp4-sp"])
@pytest.mark.slow
def test_layouts_of_the_kv_heads_equal_one_device(plan):
    """One step of tiny-llama: tp=4 keeps its 2 k/v heads whole (each device picks its
    own), tp=2 splits them, the cp ring passes rotated keys. The loss within
    fp32_sum_bound(n) of the single device's (n target tokens summed in another order),
    every gradient within 1e-5 relative (compare_trees.max_rel_diff)."""
    ref, ref_loss, _, _ = one_step("tiny-llama")
    grads, loss, _, _ = one_step("tiny-llama", **plan)
    assert abs(loss - ref_loss) <= fp32_sum_bound(setup("tiny-llama")[2]["mask"].sum()) * ref_loss
    assert compare_trees.max_rel_diff(grads, ref) <= 1e-5


@pytest.mark.parametrize("plan", [dict(dp=2, tp=4, zero_stage=1), dict(pp=2, tp=2, micro_batches=2)],
                         ids=["tp4-kv-whole-zero1", "pp2-tp2-untied-head"])
@pytest.mark.slow
def test_the_canonical_form_carries_the_new_tensors(plan):
    """Two steps of momentum SGD under the plan: its canonical state (what a checkpoint
    holds: W3, the untied head, k/v weights of 2 heads, no biases) within 1e-5 relative of
    the single device's, and from_canonical(to_canonical(state)) gives the plan's state
    back bit for bit."""
    canonical, ref, state, back = canonical_after_two_steps("tiny-llama", **plan)
    assert {"unembed", "blocks"} <= set(canonical.params) and "w3" in canonical.params["blocks"]
    assert compare_trees.max_rel_diff(canonical.params, ref.params) <= 1e-5
    assert compare_trees.max_rel_diff(canonical.opt_state[0].trace, ref.opt_state[0].trace) <= 1e-5
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_the_garden_llama_trains_toward_the_entropy_floor():
    """tiny-llama gets within 0.1 nats of the corpus's entropy floor in at most 400 steps
    (measured: 0.034 after 300 steps, where tiny, the GPT preset, is at 0.088)."""
    r = train(TrainConfig(model="tiny-llama", steps=400, eval_every=20, stop_gap=0.1),
              progress=False)
    assert r.gap <= 0.1 and r.val_loss > r.entropy_floor and r.steps_run <= 400


# --- Hugging Face config.json

LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
    "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "torch_dtype": "bfloat16", "transformers_version": "4.43.0.dev0", "use_cache": True,
    "vocab_size": 128256}
GPT2_SMALL = {
    "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"],
    "attn_pdrop": 0.1, "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256,
    "initializer_range": 0.02, "layer_norm_epsilon": 1e-05, "model_type": "gpt2",
    "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024,
    "resid_pdrop": 0.1, "summary_activation": None, "summary_first_dropout": 0.1,
    "summary_proj_to_labels": True, "summary_type": "cls_index", "summary_use_proj": True,
    "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
    "vocab_size": 50257}


def _write(tmp_path, fields) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(fields))
    return str(path)


def test_hf_configs_give_the_published_models(tmp_path):
    """Llama 3.1 8B's config.json is llama3-8b (with its RoPE scaling, 131,072 positions);
    GPT-2's has the 124,439,808 parameters of the published checkpoint."""
    llama = model_config.preset(_write(tmp_path, LLAMA31_8B))
    assert llama == dataclasses.replace(model_config.preset("llama3-8b"), seq_len=131072,
                                        rope_scaling=(8.0, 1.0, 4.0, 8192.0))
    gpt2 = model_config.preset(_write(tmp_path, GPT2_SMALL))
    assert model_config.param_count(gpt2) == 124_439_808
    assert (gpt2.norm, gpt2.mlp, gpt2.position, gpt2.tied_head, gpt2.d_ff) == (
        "layernorm", "gelu", "learned", True, 3072)


@pytest.mark.parametrize("change, words", [
    ({"sliding_window": 4096}, "fields jaxscale does not know: sliding_window"),
    ({"hidden_size": None}, "hidden_size must be a positive whole number"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not computed"),
    ({"model_type": "mistral"}, "model_type 'mistral' is not one jaxscale builds"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"num_key_value_heads": 5}, "n_kv_heads=5 must divide n_heads=32"),
    ({"attention_bias": True}, "both or neither"),
])
def test_bad_hf_configs_are_refused_by_name(tmp_path, change, words):
    with pytest.raises(ModelConfigError, match=words):
        model_config.preset(_write(tmp_path, {**LLAMA31_8B, **change}))


def test_missing_fields_and_unreadable_files_are_named(tmp_path):
    fields = {k: v for k, v in LLAMA31_8B.items() if k != "intermediate_size"}
    with pytest.raises(ModelConfigError, match="lacks intermediate_size"):
        model_config.preset(_write(tmp_path, fields))
    with pytest.raises(ModelConfigError, match="cannot read"):
        model_config.preset(str(tmp_path / "nowhere" / "config.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="is not JSON"):
        model_config.preset(str(tmp_path / "bad.json"))


def test_model_config_choices_are_checked():
    with pytest.raises(ModelConfigError, match="unknown norm 'batchnorm'; choose from layernorm, rmsnorm"):
        ModelConfig(vocab_size=10, seq_len=8, d_model=8, n_layers=1, n_heads=2, d_ff=8,
                    norm="batchnorm")
    with pytest.raises(ModelConfigError, match="head_dim=3 must be even"):
        ModelConfig(vocab_size=10, seq_len=8, d_model=6, n_layers=1, n_heads=2, d_ff=8,
                    position="rope")


@pytest.mark.slow
def test_every_default_strategy_of_compare_passes_on_tiny_llama(tmp_path):
    """`jaxscale compare --model tiny-llama` on 8 devices in a fresh process: every default
    strategy (tp=4 with 2 k/v heads kept whole, the cp=8 ring with RoPE, fsdp+tp splitting
    them, pipelines with the untied head...) within the measured loss bound, and every
    measured state and collective byte equal to its prediction."""
    from conftest import run_python
    r = run_python("from jaxscale.cli.main import main; import sys; sys.exit(main(sys.argv[1:]))",
                   "compare", "--model", "tiny-llama", "--steps", "3", "--repeats", "3",
                   "--out", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["all_pass"] and res["complete"] and len(res["rows"]) == 15
    assert "tp=4 does not divide the 2 k/v heads" in r.stderr
    for row in res["rows"]:
        assert row["states_measured"] == row["states_predicted"], row["name"]
        for op in set(row["sent"]) | set(row["predicted"]["sent"]):
            assert row["sent"].get(op, 0) == pytest.approx(row["predicted"]["sent"].get(op, 0),
                                                           rel=1e-12), (row["name"], op)
