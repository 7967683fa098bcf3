"""The cost model with a mixture of experts: parameters total and active, FLOPs of the
active ones, states split over ep, the all-to-all's bytes, and the planner's search over
ep; a dense model's figures unchanged."""
import pytest

from jaxscale.costmodel import planner
from jaxscale.costmodel.devices import DEVICES
from jaxscale.costmodel.layout import Layout, memory
from jaxscale.costmodel.shape import ShapeError, Transformer
from jaxscale.costmodel.steptime import ACT_BYTES, flops_per_token, step_time
from jaxscale.model import config as model_config

MIXTRAL = Transformer(32, 4096, 32, 4096, ffn=14336, kv_heads=8, vocab=32000, swiglu=True,
                      tied=False, experts=8, top_k=2)


def test_parameters_are_the_models_less_its_norms():
    """The cost model leaves norms out: Mixtral's published 46,702,792,704 less 2 L h + h."""
    cfg = model_config.preset("mixtral-8x7b")
    norms = (2 * cfg.n_layers + 1) * cfg.d_model
    assert MIXTRAL.params() == model_config.param_count(cfg) - norms
    assert MIXTRAL.params(active=True) == model_config.param_count(cfg, active=True) - norms
    assert MIXTRAL.active().params() + 32 * 4096 * 8 == MIXTRAL.params(active=True)  # + router


def test_flops_count_the_active_parameters():
    dense = MIXTRAL.active()
    router = 6 * 32 * 4096 * 8  # 6 x the router's weights per token
    assert flops_per_token(MIXTRAL)["model"] == flops_per_token(dense)["model"] + router


def test_ep_splits_the_experts_states_and_nothing_else():
    """fp32 Adam (16 B a parameter), no ZeRO, 64 devices as dp=8 x ep=8: the experts' states
    1/8 on each device, the rest whole."""
    mem = memory(MIXTRAL, Layout(dp=8, ep=8), 64, budget="fp32-adam")
    experts = MIXTRAL.expert_params()
    assert mem["states"] == pytest.approx(16 * ((MIXTRAL.params() - experts) + experts / 8))
    dense = Transformer(32, 4096, 32, 4096, vocab=32000)
    assert memory(dense, Layout(dp=8), 64, budget="fp32-adam")["states"] == 16 * dense.params()


def test_all_to_all_bytes_are_four_per_layer_and_micro_batch():
    """dp=2 x ep=4, micro-batches of 1 sequence: per layer and micro-batch four all-to-alls
    of top_k x s x h 16-bit values, (ep - 1) / ep of them leaving the device."""
    lay = Layout(dp=2, ep=4, micro_batch=1)
    t = step_time(MIXTRAL, lay, 16, DEVICES["h100"])
    m = lay.micro_batches(16)
    assert m == 2
    assert t["bytes_sent"]["ep"] == pytest.approx(
        4 * 32 * m * 3 / 4 * 2 * 4096 * 4096 * ACT_BYTES)
    assert t["ep"] > 0 and step_time(MIXTRAL, Layout(dp=8), 16, DEVICES["h100"])["ep"] == 0


def test_the_planner_searches_ep_for_experts_only():
    job = planner.Job(MIXTRAL, batch=256, devices=64, device=DEVICES["h100"])
    rows = planner.ranked(job)
    assert any(r["layout"]["ep"] > 1 for r in rows)
    assert all(8 % r["layout"]["ep"] == 0 for r in rows)
    dense = planner.Job(MIXTRAL.active(), batch=256, devices=64, device=DEVICES["h100"])
    assert all(r["layout"]["ep"] == 1 for r in planner.ranked(dense))


def test_ep_without_dividing_experts_is_refused():
    with pytest.raises(ShapeError, match="ep 3 must divide the model's experts"):
        memory(MIXTRAL, Layout(dp=1, ep=3), 3)
    with pytest.raises(ShapeError, match="top_k 9 must be 1 to experts 8"):
        Transformer(2, 64, 4, experts=8, top_k=9)


def test_a_fixed_dp_or_ep_is_held_for_experts():
    """With experts a mesh's dp is dp x ep: --fix dp=8 keeps dp itself at 8 (ep beside it),
    --fix ep=4 keeps ep; an ep that cannot split the experts is refused by name."""
    job = planner.Job(MIXTRAL, batch=256, devices=64, device=DEVICES["h100"],
                      fixed=(("dp", 8),))
    rows = planner.ranked(job)
    assert rows and all(r["layout"]["dp"] == 8 for r in rows)
    assert any(r["layout"]["ep"] > 1 for r in rows)
    fixed_ep = planner.Job(MIXTRAL, batch=256, devices=64, device=DEVICES["h100"],
                           fixed=(("ep", 4),))
    assert all(r["layout"]["ep"] == 4 for r in planner.ranked(fixed_ep))
    with pytest.raises(planner.cm.CostModelError, match="cannot fix ep=3"):
        planner.check(planner.Job(MIXTRAL, batch=256, devices=64, device=DEVICES["h100"],
                                  fixed=(("ep", 3),)))


def test_interleaved_experts_count_their_blocks_only():
    """Mixtral's shape with experts in every second block (moe_every=2; the dense blocks'
    MLP as wide as an expert): parameters the model's less its norms, total and active;
    FLOPs 6 x the active matmul weights per token (+ attention); ep's all-to-alls and
    split states for the 16 expert blocks only."""
    import dataclasses
    cfg = dataclasses.replace(model_config.preset("mixtral-8x7b"), moe_every=2)
    shape = dataclasses.replace(MIXTRAL, moe_every=2, dense_ffn=14336)
    norms = (2 * cfg.n_layers + 1) * cfg.d_model
    assert shape.params() == model_config.param_count(cfg) - norms
    assert shape.params(active=True) == model_config.param_count(cfg, active=True) - norms
    assert shape.expert_params() == MIXTRAL.expert_params() / 2
    dense = Transformer(32, 4096, 32, 4096, ffn=14336, kv_heads=8, vocab=32000, swiglu=True,
                        tied=False)
    router = 16 * 4096 * 8
    # the active blocks: 16 with two experts' MLPs, 16 with one: one dense model's FLOPs
    # with a mean width of 1.5 experts
    assert flops_per_token(shape)["model"] == pytest.approx(
        flops_per_token(dataclasses.replace(dense, ffn=1.5 * 14336))["model"] + 6 * router)
    lay = Layout(dp=2, ep=4, micro_batch=1)
    assert step_time(shape, lay, 16, DEVICES["h100"])["bytes_sent"]["ep"] == pytest.approx(
        step_time(MIXTRAL, lay, 16, DEVICES["h100"])["bytes_sent"]["ep"] / 2)
    mem = memory(shape, Layout(dp=8, ep=8), 64, budget="fp32-adam")
    experts = shape.expert_params()
    assert mem["states"] == pytest.approx(16 * ((shape.params() - experts) + experts / 8))
    with pytest.raises(ShapeError, match="moe_every 3 must divide layers 32"):
        dataclasses.replace(MIXTRAL, moe_every=3)


def test_shared_experts_and_the_capacity_factor():
    """A DeepSeek-style block (2 shared experts beside the top-2 of 8) counts the shared
    ones in every token's parameters and FLOPs, not in what ep splits; a capacity factor
    of 1.25 sends 1.25 x the all-to-all bytes of a dropless exchange."""
    import dataclasses
    cfg = dataclasses.replace(model_config.preset("mixtral-8x7b"), n_shared_experts=2,
                              capacity_factor=1.25)
    shared = dataclasses.replace(MIXTRAL, shared=2)
    norms = (2 * cfg.n_layers + 1) * cfg.d_model
    assert shared.params() == model_config.param_count(cfg) - norms
    assert shared.params(active=True) == model_config.param_count(cfg, active=True) - norms
    assert shared.expert_params() == MIXTRAL.expert_params()
    assert shared.active().f == 4 * 14336
    lay = Layout(dp=2, ep=4, micro_batch=1)
    sent = step_time(dataclasses.replace(MIXTRAL, capacity_factor=1.25), lay, 16,
                     DEVICES["h100"])["bytes_sent"]["ep"]
    assert sent == pytest.approx(1.25 * step_time(MIXTRAL, lay, 16, DEVICES["h100"])["bytes_sent"]["ep"])
    with pytest.raises(ShapeError, match="capacity factor > 0"):
        dataclasses.replace(MIXTRAL, capacity_factor=0.0)
