"""How the model computes, checked against the reference: attention kernels (einsum against
jax.nn.dot_product_attention), layers scanned or unrolled, and the Plan fields that pick
them. cuDNN's kernel needs a GPU: tests/model/test_gpu.py."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxscale.model import attention, transformer as M
from jaxscale.measure import compare_trees
from jaxscale.model.loss import loss_fn
from jaxscale.parallel.plan import Plan, PlanError
from jaxscale.parallel.build import build_train_step

from conftest import KEEP_GRADIENT, fp32_sum_bound, one_step, setup
from jaxscale.model import config as model_config


@functools.lru_cache(maxsize=None)
def logits_and_grads(model: str, attention: str, unroll: bool):
    cfg, params, batch = setup(model)
    batch = {k: v[:8] for k, v in batch.items()}
    graphdef = nnx.graphdef(M.abstract(cfg, attention=attention, unroll=unroll))
    logits = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, batch["tokens"])
    grads = jax.jit(jax.grad(lambda p: loss_fn(graphdef, p, batch)))(params)
    return np.asarray(logits), jax.tree.map(np.asarray, grads)


def _global_rel(a, b) -> float:
    """Largest difference of any gradient entry, over the largest gradient entry."""
    diff = max(float(np.abs(x - y).max()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    return diff / max(float(np.abs(y).max()) for y in jax.tree.leaves(b))


@pytest.mark.parametrize("model", ["tiny", "small"])
@pytest.mark.slow
def test_dot_product_attention_equals_the_einsum_reference(model):
    """jax.nn.dot_product_attention(implementation="xla") on CPU against the written-out
    einsums, fp32. Measured: logits bit-identical (max abs diff 0.0, both lower to the same
    ops), gradients within 4e-7 of each tensor's largest entry (its backward is summed in
    another order). Bounds, as sums in another order: a logit's attention sums at most
    seq_len = 64 terms, fp32_sum_bound(64) = 9.5e-7 of the largest logit; a gradient entry
    sums the n = 185 target tokens' contributions, fp32_sum_bound(n) = 1.6e-6 of the largest
    gradient entry, not per tensor: the key bias's exact gradient is 0 (softmax ignores a
    shift shared by a row's scores), so both kernels give it rounding noise of 1e-10 that
    no relative bound can compare."""
    ref_logits, ref_grads = logits_and_grads(model, "einsum", False)
    logits, grads = logits_and_grads(model, "xla", False)
    assert (np.abs(logits - ref_logits).max()
            <= fp32_sum_bound(logits.shape[1]) * np.abs(ref_logits).max())
    assert _global_rel(grads, ref_grads) <= fp32_sum_bound(setup(model)[2]["mask"][:8].sum())


@pytest.mark.parametrize("model", ["tiny", "small"])
@pytest.mark.slow
def test_unrolled_layers_equal_the_scanned_ones(model):
    """The same layers written out L times instead of one loop body: measured bit-identical
    (0.0) on CPU for logits and gradients; bounds as the kernels' above (sums in another
    order: fp32_sum_bound(seq_len) of the largest logit, fp32_sum_bound(n target tokens) of
    the largest gradient entry), as XLA may fuse across the written-out layers in another
    order on another machine."""
    ref_logits, ref_grads = logits_and_grads(model, "einsum", False)
    logits, grads = logits_and_grads(model, "einsum", True)
    assert (np.abs(logits - ref_logits).max()
            <= fp32_sum_bound(logits.shape[1]) * np.abs(ref_logits).max())
    assert _global_rel(grads, ref_grads) <= fp32_sum_bound(setup(model)[2]["mask"][:8].sum())


def test_an_unrolled_program_has_no_loop_and_a_scanned_one_has():
    cfg, params, batch = setup("tiny")
    text = {}
    for unroll in (False, True):
        graphdef = nnx.graphdef(M.abstract(cfg, unroll=unroll))
        text[unroll] = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t)).lower(
            params, batch["tokens"]).as_text()
    assert "stablehlo.while" in text[False] and "stablehlo.while" not in text[True]


@pytest.mark.slow
def test_tensor_parallel_heads_split_under_dot_product_attention(devices):
    """tp=2 with the xla kernel against the single-device einsum step: each device runs
    dot_product_attention on its own heads. Bounds as tensor parallelism's own: the loss
    within sqrt(n) eps_fp32 (_loss_bound), gradients 1e-5 per tensor (test_tensor_parallel)."""
    ref, ref_loss, _, _ = one_step("tiny")
    grads, loss, _, _ = one_step("tiny", tp=2, attention="xla")
    assert abs(loss - ref_loss) <= _loss_bound(ref_loss)
    assert compare_trees.max_rel_diff(grads, ref) <= 1e-5


def _traced(plan: dict, monkeypatch):
    """Build `plan` with the xla kernel, scanned and unrolled, and run the unrolled step once,
    recording what the layers were traced with. Returns (the attention kernels, the `unroll`
    values model.layers_with_stats got while each program was traced, the loops in each program, the
    unrolled step's loss, the single-device reference loss)."""
    cfg, params, batch = setup("tiny")
    _, ref_loss, _, _ = one_step("tiny")
    kernels, unrolls, loops = [], {False: set(), True: set()}, {}
    attend, layers = attention.attend, M.layers_with_stats  # (M.layers calls it too)
    monkeypatch.setattr(attention, "attend", lambda q, k, v, kernel="einsum":
                        kernels.append(kernel) or attend(q, k, v, kernel))
    for unroll in (False, True):
        monkeypatch.setattr(M, "layers_with_stats", lambda *a, unroll=False,
                            _seen=unrolls[unroll], **kw:
                            _seen.add(unroll) or layers(*a, unroll=unroll, **kw))
        p = Plan(**plan, attention="xla", unroll=unroll)
        init, step = build_train_step(cfg, p, KEEP_GRADIENT, jax.devices()[:p.n_devices])
        state = init(params)
        hlo = step.jitted.lower(state, step.place_batch(batch)).as_text()
        loops[unroll] = hlo.count("= stablehlo.while(")
    _, metrics = step(state, batch)
    return kernels, unrolls, loops, float(metrics["loss"]), ref_loss


def _loss_bound(ref_loss: float) -> float:
    """sqrt(n) fp32 epsilons of the loss, n the batch's target tokens (about 3.1e-6
    relative here): the typical rounding of an n-term fp32 sum taken in another order.
    Measured against the single-device reference: 1.0e-7 (1 ulp) on one machine, 1.03e-6
    on another, where the single-device program's loss landed 10 ulps from every sharded
    program's (a 1e-6 bound failed there)."""
    _, _, batch = setup("tiny")
    return float(np.sqrt(batch["mask"].sum()) * np.finfo(np.float32).eps) * ref_loss


@pytest.mark.slow
def test_zero3_takes_the_kernel_and_unrolls_its_gathered_layers(devices, monkeypatch):
    """ZeRO-3 runs its own forward over gathered layers (not model.layers): every attention
    call is traced with the Plan's kernel, the unrolled program has fewer loops than the
    scanned one, and the loss equals the single-device reference's."""
    kernels, _, loops, loss, ref_loss = _traced(dict(dp=2, zero_stage=3), monkeypatch)
    assert kernels and set(kernels) == {"xla"}, kernels
    assert loops[True] < loops[False], loops
    assert abs(loss - ref_loss) <= _loss_bound(ref_loss)


@pytest.mark.slow
def test_a_pipeline_stage_takes_the_kernel_and_the_unrolling(devices, monkeypatch):
    """A pipeline stage runs its share of the layers through model.layers_with_stats (the
    routers' figures beside, for a mixture of experts) with the Plan's
    kernel and unrolling (tiny's stages hold one layer each, so the programs' loop counts
    cannot tell: the call is recorded instead); the loss equals the reference's."""
    kernels, unrolls, _, loss, ref_loss = _traced(dict(pp=2, micro_batches=2), monkeypatch)
    assert kernels and set(kernels) == {"xla"}, kernels
    assert unrolls == {False: {False}, True: {True}}, unrolls
    assert abs(loss - ref_loss) <= _loss_bound(ref_loss)


def test_plan_parses_and_writes_the_kernel_and_unroll():
    p = Plan.parse("dp=2,attention=xla,unroll=1")
    assert (p.attention, p.unroll) == ("xla", True)
    assert p.layout() == "dp=2,attention=xla,unroll=1"
    assert Plan.parse(p.layout()) == p


@pytest.mark.parametrize("layout, words", [
    ("attention=flash", ["'flash'", "einsum, xla, cudnn"]),
    ("unroll=yes", ["unroll must be 0 or 1", "'yes'"]),
    ("attention=cudnn", ["cuDNN flash attention takes bf16 or fp16", "float32", "fp32"]),
])
def test_bad_kernel_choices_name_the_value_and_the_choices(layout, words):
    with pytest.raises(PlanError) as e:
        Plan.parse(layout)
    for w in words:
        assert w in str(e.value)


def test_cudnn_is_refused_on_cpu_devices_before_compiling(devices):
    cfg, _, _ = setup("tiny")
    with pytest.raises(PlanError, match="cuDNN flash attention runs on NVIDIA GPUs; these "
                                        "devices are cpu"):
        build_train_step(cfg, Plan(precision="bf16", attention="cudnn"), None, devices[:1])


def test_the_model_refuses_an_unknown_kernel():
    with pytest.raises(model_config.ModelConfigError, match="unknown attention kernel 'flash'"):
        M.abstract(model_config.preset("tiny"), attention="flash")


def test_mid_preset_is_gpt2_medium_shaped_with_a_vocabulary_of_128():
    cfg = model_config.preset("mid")
    assert cfg.vocab_size % 128 == 0 and cfg.seq_len == 1024 and cfg.head_dim == 64
    n = M.count_params(M.abstract(cfg))
    assert n == model_config.param_count(cfg) and 125e6 <= n <= 350e6


def test_dot_product_attention_keeps_causality():
    """Changing a later token changes no earlier position's output under either kernel."""
    key = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (1, 6, 2, 4)) for kk in key)
    v2 = v.at[:, 4:].set(7.0)
    for f in (attention.causal_attention,
              lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                           implementation="xla")):
        assert jnp.array_equal(f(q, k, v)[:, :4], f(q, k, v2)[:, :4])
        assert not jnp.array_equal(f(q, k, v)[:, 4:], f(q, k, v2)[:, 4:])
