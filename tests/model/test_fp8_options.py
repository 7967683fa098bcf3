"""The FP8 options: fp8-block's tile length (`fp8_block`) and the output head under the
recipe (`fp8_head`), through every layout and the command line."""
import jax
import numpy as np
import pytest

from jaxscale.model import fp8, fp8_watch
from jaxscale.parallel.build import build_train_step
from jaxscale.parallel.plan import Plan, PlanError

from conftest import KEEP_GRADIENT, one_step, setup


@pytest.mark.slow
def test_a_smaller_tile_reaches_the_mesh_layouts(devices):
    """fp8-block with 16-long tiles: dp x tp follows its own single device within the fp8
    layouts' 1e-4 (tests/model/test_fp8.py says why), and the tile changed the numbers.
    (Every layout takes the tile through Plan.family, as it takes the recipe.)"""
    single = one_step("tiny8", precision="fp8-block", fp8_block=16)[1]
    _, loss, *_ = one_step("tiny8", precision="fp8-block", fp8_block=16, dp=2, tp=2)
    assert abs(loss - single) / single <= 1e-4
    assert single != one_step("tiny8", precision="fp8-block")[1]


@pytest.mark.parametrize("plan", [dict(dp=4, zero_stage=3), dict(pp=2, micro_batches=2)],
                         ids=["zero3", "pp"])
@pytest.mark.slow
def test_an_fp8_head_follows_the_single_device_in_the_layouts_that_run_it_apart(devices,
                                                                              plan):
    """ZeRO-3 runs the head as its own checkpointed unit on gathered slices; a pipeline
    runs it on the last stage only: both follow the single device's fp8 head (1e-4)."""
    single = one_step("tiny8", precision="fp8", fp8_head=True)[1]
    _, loss, *_ = one_step("tiny8", precision="fp8", fp8_head=True, **plan)
    assert abs(loss - single) / single <= 1e-4


@pytest.mark.slow
def test_the_head_option_puts_the_output_projection_under_the_recipe():
    """With fp8_head the tied head (the token table, vocab x d) is one more FP8 product:
    the weights the step casts are the blocks' matmul weights (tests/model/
    test_fp8_watch.py counts them without the head) plus exactly the table."""
    cfg, params, batch = setup("tiny")
    init, step = build_train_step(cfg, Plan(precision="fp8", fp8_head=True), KEEP_GRADIENT)
    tally = fp8_watch.Tally()
    with fp8_watch.watching(tally):
        _, metrics = step(init(params), batch)
    jax.effects_barrier()
    blocks = params["blocks"]
    matmul_weights = sum(blocks[k].size for k in ("wq", "wk", "wv", "wo", "w1", "w2"))
    assert tally.sums["weights"]["elements"] == matmul_weights + params["tok_embed"].size
    assert np.isfinite(float(metrics["loss"]))


@pytest.mark.parametrize("fields, match", [
    (dict(precision="bf16", fp8_block=64), "precision=fp8-block"),
    (dict(precision="fp32", fp8_head=True), "has none"),
    (dict(precision="fp8-block", fp8_block=0), "positive integer"),
    (dict(precision="fp8-block", fp8_block=True), "positive integer"),
])
def test_options_that_cannot_apply_are_named(fields, match):
    with pytest.raises(PlanError, match=match):
        Plan(**fields).validate()


def test_the_command_line_names_the_dimension_a_tile_does_not_divide(fail):
    err = fail("train", "--steps", "2", "--precision", "fp8-block", "--fp8-block", "24")
    assert "fp8-block tiles by 24: d_model = 32" in err
    err = fail("train", "--steps", "2", "--precision", "fp8-block", "--fp8-block", "16",
               "--fp8-head")
    assert "vocab_size = 101" in err and "tiles that fit:" in err


def test_a_tile_below_one_is_refused_by_the_recipe_itself():
    """Below Plan, the model's own entry refuses it too, rather than scaling per tensor."""
    assert fp8.matmul("fp8-block", 16).keywords == {"block": 16}
    with pytest.raises(ValueError, match="got 0"):
        fp8.matmul("fp8-block", 0)


def test_a_checkpoint_resumes_only_under_its_own_fp8_options():
    """The options change the numbers, as the precision does: a resumed run must share
    them. A checkpoint written before they existed counts as their defaults."""
    from dataclasses import asdict

    from jaxscale.training.checkpoint import store
    from jaxscale.training.config import TrainConfig
    old = {"format": store.FORMAT, "config": {k: v for k, v in asdict(TrainConfig(
        precision="fp8")).items() if not k.startswith("fp8_")}}
    store.check_compatible(old, asdict(TrainConfig(precision="fp8")), False, "here")
    with pytest.raises(store.CheckpointError, match="fp8_head=False .* leave out --fp8-head"):
        store.check_compatible(old, asdict(TrainConfig(precision="fp8", fp8_head=True)),
                               False, "here")
    saved = {**old, "config": asdict(TrainConfig(precision="fp8-block", fp8_block=64))}
    with pytest.raises(store.CheckpointError, match="fp8_block=64 .* use --fp8-block 64"):
        store.check_compatible(saved, asdict(TrainConfig(precision="fp8-block")), False, "x")


def test_compare_takes_the_options_for_every_strategy_and_names_them(fail):
    from dataclasses import replace

    from jaxscale.compare.child import mesh_label
    from jaxscale.compare.strategies import check_strategies
    from jaxscale.model import config as model_config
    err = fail("compare", "--strategies", "dp", "--fp8-head")
    assert "--fp8-head applies to an fp8 --precision" in err
    tiny = model_config.preset("tiny")
    plans = check_strategies(["single", "dp"], 2, tiny, (), "fp8-block", {"fp8_block": 16})
    assert {(p.precision, p.fp8_block) for p in plans.values()} == {("fp8-block", 16)}
    assert mesh_label(plans["dp"].as_dict()).endswith("fp8-block tile 16")
    assert "tile" not in mesh_label(replace(plans["dp"], fp8_block=128).as_dict())
    plans = check_strategies(["single", "dp"], 2, tiny, (), "fp8", {"fp8_head": True})
    assert all(p.fp8_head for p in plans.values())
    assert mesh_label(plans["dp"].as_dict()).endswith("fp8 FP8 head")
