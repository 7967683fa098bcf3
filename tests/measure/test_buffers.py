"""XLA's buffer assignment read back (jaxscale.measure.buffers) and jax's saved residuals
of one block (jaxscale.measure.residuals), each against a figure of its own source."""
import jax
import jax.numpy as jnp
import pytest

from jaxscale.measure import buffers, memory, residuals
from jaxscale.model import config as model_config
from jaxscale.parallel.plan import Plan


def _mlp_step():
    def loss(ws, x):
        for i, w in enumerate(ws):
            with jax.named_scope(f"layer{i}"):
                x = jax.nn.relu(x @ w)
        return jnp.sum(x ** 2)

    def step(ws, x):
        return jax.tree.map(lambda w, g: w - 0.1 * g, ws, jax.grad(loss)(ws, x))
    ws = [jnp.ones((256, 256), jnp.float32) for _ in range(3)]
    return jax.jit(step).lower(ws, jnp.ones((512, 256), jnp.float32)).compile()


def test_peak_buffers_add_up_to_xla_s_memory_analysis():
    """Arguments and outputs to the byte; the temporaries live together at the heap's peak
    within the heap's size (its packing may leave gaps), and each is named by the
    instruction that makes it and jax's op_name."""
    compiled = _mlp_step()
    rows = buffers.peak_buffers(compiled)
    kinds, m = buffers.by_kind(rows), memory.memory(compiled)
    assert kinds["argument"] == m["arguments"] == 3 * 256 * 256 * 4 + 512 * 256 * 4
    assert kinds["output"] == m["outputs"] >= 3 * 256 * 256 * 4  # (and the tuple's table)
    assert 0 < kinds["temporary"] <= m["temporaries"]
    temps = [r for r in rows if r["kind"] == "temporary"]
    assert temps == sorted(temps, key=lambda r: -r["bytes"])
    assert temps[0]["bytes"] == 512 * 256 * 4 and temps[0]["shape"] == "f32[512,256]"
    assert any("layer" in r["op_name"] for r in temps), temps  # the named scopes come back
    assert all(r["instruction"] for r in rows)


def test_shapes_read_from_the_proto_are_hlo_s():
    compiled = _mlp_step()
    text = compiled.as_text()
    for r in buffers.peak_buffers(compiled):
        name = r["instruction"].split("{")[0]
        if "{" not in r["instruction"] and r["shape"] != "?":
            assert f"{r['shape']}" in text and name in text


CFG = model_config.preset("tiny8")


def test_full_recomputation_keeps_only_the_block_input():
    r = residuals.block_residuals(CFG, Plan(remat="full"), 8)
    assert [x["made_by"] for x in r["rows"]] == ["the block's input"]
    assert r["per_layer"] == 8 * CFG.seq_len * CFG.d_model * 4
    assert r["total"] == r["per_layer"] * CFG.n_layers


def test_selective_keeps_the_projections_not_the_attention_scores():
    none, sel = (residuals.block_residuals(CFG, Plan(remat=m), 8) for m in ("none", "selective"))
    scores = [8, CFG.n_heads, CFG.seq_len, CFG.seq_len]
    assert any(x["shape"] == scores for x in none["rows"])
    assert not any(x["shape"] == scores for x in sel["rows"])
    assert any("dot_general" in x["made_by"] for x in sel["rows"])
    assert sel["per_layer"] < none["per_layer"]


def test_the_layout_sets_rows_heads_tokens_and_dtype():
    """dp x micro-batches divide the rows, tp the heads, bf16 halves what it casts; a
    pipeline holds stage inputs in flight and one chunk's residuals."""
    base = residuals.block_residuals(CFG, Plan(remat="full"), 8)
    dp = residuals.block_residuals(CFG, Plan(dp=2, micro_batches=2, remat="full"), 8)
    assert dp["rows_per_micro_batch"] == 2 and dp["per_layer"] * 4 == base["per_layer"]
    tp = residuals.block_residuals(CFG, Plan(tp=2), 8)
    heads = [x["shape"][1] for x in tp["rows"] if len(x["shape"]) == 4 and
             x["shape"][2:] == [CFG.seq_len, CFG.seq_len]]
    assert heads and set(heads) == {CFG.n_heads // 2}
    bf16 = residuals.block_residuals(CFG, Plan(precision="bf16", remat="full"), 8)
    assert bf16["rows"][0]["dtype"] == "bfloat16"
    pp = residuals.block_residuals(CFG, Plan(pp=2, micro_batches=4), 8)
    stage_input = 2 * CFG.seq_len * CFG.d_model * 4  # 2 rows a micro-batch
    # 1F1B on 2 stages: 2 stage inputs in flight (the first stage) and 1 gradient slot
    assert pp["total"] == (2 + 1) * stage_input + pp["per_layer"] * CFG.n_layers // 2
    zb = residuals.block_residuals(CFG, Plan(pp=2, micro_batches=4, schedule="zb-h1"), 8)
    assert zb["total"] > pp["total"] and "waiting for W" in zb["how"]
    zero3 = residuals.block_residuals(CFG, Plan(dp=2, zero_stage=3), 8)
    plain = residuals.block_residuals(CFG, Plan(dp=2), 8)
    assert zero3["per_layer"] < plain["per_layer"]  # ZeRO-3's layers keep matmul outputs


def test_interleaved_experts_hold_each_kind_of_block_s_residuals():
    """tiny-switch (4 blocks, experts in the 2nd and 4th): the blocks hold 2 dense blocks'
    residuals (as the same model without experts holds per block) + 2 expert blocks' (as
    the same model with experts in every block holds per block); each row says its kind."""
    import dataclasses
    cfg = model_config.preset("tiny-switch")
    both = residuals.block_residuals(cfg, Plan(), 8)
    dense = residuals.block_residuals(
        dataclasses.replace(cfg, n_experts=0, top_k=2, moe_every=1), Plan(), 8)["per_layer"]
    moe = residuals.block_residuals(dataclasses.replace(cfg, moe_every=1), Plan(), 8)["per_layer"]
    assert dense != moe
    assert both["total"] == 2 * dense + 2 * moe
    assert both["how"] == f"{dense:,} B a dense block x 2 + {moe:,} B an expert block x 2"
    assert {x["made_by"].split(")")[0] for x in both["rows"]} == {"(a dense block",
                                                                  "(an expert block"}


@pytest.mark.parametrize("source, short", [
    ("output of dot_general from /x/jaxscale/model/block.py:92:19 (attention)",
     "dot_general, model/block.py:92 (attention)"),
    ("output of jitted function '_where' from /x/jaxscale/model/attention.py:70:13 "
     "(causal_attention)", "_where, model/attention.py:70 (causal_attention)"),
])
def test_sources_are_shortened(source, short):
    assert residuals._short(source) == short


def test_the_text_dump_gives_the_same_buffers():
    """XLA:TPU keeps its assignment back and writes it as text: read on XLA:CPU's dump,
    the program's peak holds its arguments and the largest temporaries, by the same names
    the proto gives."""
    from jaxscale.measure import buffer_dump
    ws = [jnp.ones((256, 256), jnp.float32) for _ in range(3)]
    x = jnp.ones((512, 256), jnp.float32)
    step = jax.jit(lambda ws, x: jax.grad(lambda ws: jnp.sum(
        jax.nn.relu(jax.nn.relu(x @ ws[0]) @ ws[1]) @ ws[2]))(ws))
    compiled = step.lower(ws, x).compile()  # (kept in the cache: the dump must not hit it)
    dumped_program, dumped = buffer_dump.compile_and_read(step, ws, x)
    proto = {r["instruction"]: r for r in buffers.peak_buffers(compiled)}
    assert dumped and all(r["bytes"] > 0 and r["shape"] != "?" for r in dumped)
    assert {r["kind"] for r in dumped} >= {"argument"}
    assert memory.memory(dumped_program) == memory.memory(compiled)  # the same program
    shared = [r for r in dumped if r["instruction"] in proto]
    assert shared and all(proto[r["instruction"]]["shape"] == r["shape"] for r in shared)
    # named as the program's own ops, not the dump's wrapper
    named = [r for r in shared if r["op_name"]]
    assert named and all(proto[r["instruction"]]["op_name"] == r["op_name"] for r in named)


@pytest.mark.parametrize("shape, index, part", [
    ("f32[8,128]{1,0:T(8,128)}", (), "f32[8,128]"),
    ("(s32[]{:T(128)}, f32[2,8]{1,0}, /*index=2*/(bf16[4], u32[]))", (2, 0), "bf16[4]"),
])
def test_tuple_parts_and_layouts(shape, index, part):
    from jaxscale.measure import buffer_dump
    assert buffer_dump._part(shape, index) == part
