"""The stack of blocks with interleaved experts (jaxscale.model.stack): a cut keeps whole
groups with their own dense MLPs and experts, a silent stack is the identity, and the
stacks every other model builds are walked block by block as before."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxscale.model import config as model_config, stack, transformer as M


def _params(name: str, **change):
    cfg = dataclasses.replace(model_config.preset(name), **change)
    return cfg, nnx.to_pure_dict(nnx.state(M.build(cfg), nnx.Param))


@pytest.mark.slow
def test_only_interleaved_stacks_are_walked_by_groups():
    for name, every in (("tiny", 1), ("tiny-moe", 1), ("tiny-switch", 2)):
        assert stack.interleave(_params(name)[1]["blocks"]) == every


def test_a_cut_keeps_whole_groups_and_their_own_entries():
    """The first 2 of tiny-switch's 4 blocks: 2 norms and attentions, 1 dense MLP, 1
    router and its experts, each the first of its stack; a cut inside a group refused."""
    cfg, p = _params("tiny-switch")
    cut = stack.first(p["blocks"], 2)
    assert stack.depth(cut) == 2 and stack.interleave(cut) == 2
    assert cut["w1"].shape[0] == 1 and cut["experts"]["router"].shape[0] == 1
    np.testing.assert_array_equal(cut["experts"]["w2"][0], p["blocks"]["experts"]["w2"][0])
    with pytest.raises(ValueError, match="a cut of 3 blocks splits a group of 2"):
        stack.first(p["blocks"], 3)
    logits = M.forward({**p, "blocks": cut}, jnp.zeros((1, 8), jnp.int32),
                       family=cfg.family)
    assert logits.shape == (1, 8, cfg.vocab_size)


@pytest.mark.parametrize("name", ["tiny", "tiny-switch"])
def test_a_silent_stack_is_the_identity(name):
    """Every output projection zeroed (the experts' and the shared ones' too): the
    logits are the head of the embeddings, exactly (x + 0 is x)."""
    cfg, p = _params(name, **({"n_shared_experts": 1} if name == "tiny-switch" else {}))
    quiet = stack.silent(p["blocks"], lambda v: jax.tree.map(np.zeros_like, v))
    tokens = jnp.arange(8, dtype=jnp.int32)[None] % cfg.vocab_size
    logits = M.forward({**p, "blocks": quiet}, tokens, family=cfg.family)
    alone = M.head(p, M.embed(p, tokens, None, cfg.family), cfg.family)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(alone))
