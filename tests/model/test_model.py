"""The one transformer: parameter count, logical axes, causality, the scan over layers."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxscale.model import transformer as M
from jaxscale.model import config as model_config

LOGICAL = {"vocab", "embed", "position", "heads", "head_dim", "mlp", "layers"}


@pytest.fixture(scope="module")
def tiny():
    return M.build(model_config.preset("tiny"), seed=0)


def test_tiny_is_about_the_lectures_size(tiny):
    n = M.count_params(tiny)
    assert n == model_config.param_count(model_config.preset("tiny"))
    assert abs(n - 28_672) / 28_672 < 0.1, n


@pytest.mark.parametrize("name", ["small", "1b", "7b"])
def test_param_count_closed_form_matches_abstract_model(name):
    cfg = model_config.preset(name)
    model = M.abstract(cfg)  # no allocation: 7b would not fit a laptop
    assert M.count_params(model) == model_config.param_count(cfg)
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)


def test_size_classes():
    assert 1e6 <= model_config.param_count(model_config.preset("small")) <= 1e7
    assert 0.9e9 <= model_config.param_count(model_config.preset("1b")) <= 1.5e9


def test_every_parameter_has_logical_axes(tiny):
    axes = M.logical_axes(tiny)
    params = nnx.to_pure_dict(nnx.state(tiny, nnx.Param))
    flat_axes = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
    flat_params = jax.tree.leaves(params)
    assert len(flat_axes) == len(flat_params)
    for names, value in zip(flat_axes, flat_params):
        assert len(names) == value.ndim and set(names) <= LOGICAL
    assert all(names[0] == "layers" for names in
               jax.tree.leaves(axes["blocks"], is_leaf=lambda x: isinstance(x, tuple)))
    assert axes["tok_embed"] == ("vocab", "embed")


def test_causal_future_tokens_do_not_change_the_past(tiny):
    rng = np.random.default_rng(0)
    a = rng.integers(0, model_config.preset("tiny").vocab_size, (2, 16))
    b = a.copy()
    b[:, 10:] = rng.integers(0, model_config.preset("tiny").vocab_size, (2, 6))
    la, lb = tiny(jnp.asarray(a)), tiny(jnp.asarray(b))
    np.testing.assert_array_equal(np.asarray(la[:, :10]), np.asarray(lb[:, :10]))
    assert not np.allclose(la[:, 10:], lb[:, 10:])


@pytest.mark.slow
def test_scan_equals_explicit_loop_over_layers(tiny):
    cfg = model_config.preset("tiny")
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, cfg.vocab_size)
    p = nnx.to_pure_dict(nnx.state(tiny, nnx.Param))
    x = p["tok_embed"][tokens] + p["pos_embed"][:8]
    for i in range(cfg.n_layers):
        x = M.block(jax.tree.map(lambda a: a[i], p["blocks"]), x)
    x = M.layer_norm(x, p["ln_f"]["scale"], p["ln_f"]["bias"])
    looped = x @ p["tok_embed"].T
    np.testing.assert_allclose(np.asarray(tiny(tokens)), np.asarray(looped), atol=1e-5)


def test_bad_configs_are_refused():
    with pytest.raises(model_config.ModelConfigError, match="not divisible by n_heads=3"):
        model_config.ModelConfig(vocab_size=10, seq_len=8, d_model=32, n_layers=1, n_heads=3, d_ff=8)
    with pytest.raises(model_config.ModelConfigError, match="n_layers must be positive, got 0"):
        model_config.ModelConfig(vocab_size=10, seq_len=8, d_model=32, n_layers=0, n_heads=4, d_ff=8)
    with pytest.raises(model_config.ModelConfigError, match="unknown model 'huge'.*tiny, tiny8, small"):
        model_config.preset("huge")
