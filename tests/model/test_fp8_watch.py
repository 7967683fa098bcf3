"""Counting what FP8 casts do (jaxscale.model.fp8_watch): the counts are those of ml_dtypes's
cast, every product of a training step reports, and watching changes no number."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxscale.model import fp8, fp8_watch, formats
from jaxscale.parallel.build import build_train_step
from jaxscale.parallel.plan import Plan

from conftest import KEEP_GRADIENT, setup


def test_tally_counts_what_ml_dtypes_makes_of_each_value():
    """The counts against ml_dtypes's cast of the values (formats.classify): flushed,
    subnormal, and overflow as the cast rounds, ties included (464 rounds down to 448 in
    E4M3, 61440 up to inf in E5M2)."""
    x = jnp.asarray(np.concatenate([np.random.default_rng(0).standard_normal(4000) * 1e-2,
                                    [0.0, 463.0, 464.0, 465.0, 61440.0, 7e4, 9e-4, 1e-3]]),
                    jnp.float32)
    for fmt, name in ((fp8.E4M3, "float8_e4m3fn"), (fp8.E5M2, "float8_e5m2")):
        q = jnp.clip(x, -fp8.LARGEST[fmt], fp8.LARGEST[fmt]).astype(fmt)
        counts = dict(zip(fp8_watch.COUNTS, np.asarray(fp8_watch.tally(x, x, q, fmt))))
        ref = formats.classify(np.asarray(x), name)
        n = x.size
        assert counts["elements"] == n and counts["nonzero"] == n - 1
        assert counts["flushed"] == round(ref["flushed"] * n)
        # ml_dtypes makes an E4M3 value past its largest NaN (no inf), an E5M2 one inf
        cast = np.asarray(x).astype(getattr(ml_dtypes, name)).astype(np.float32)
        assert counts["overflow"] == np.sum(~np.isfinite(cast))
        # E4M3: 465, 61440 and 7e4 (464 is a tie that rounds down); E5M2: 61440 and 7e4
        assert counts["overflow"] == (3 if fmt == fp8.E4M3 else 2)
        sub = np.asarray(q.astype(jnp.float32))
        assert counts["subnormal"] == np.sum((sub != 0) & (np.abs(sub) < ref_normal(name)))
        assert counts["unscaled_flushed"] == counts["flushed"]  # here x s = x
        assert counts["unscaled_overflow"] == counts["overflow"]


def ref_normal(name):
    return float(ml_dtypes.finfo(getattr(ml_dtypes, name)).smallest_normal)


@pytest.mark.slow
def test_every_product_of_a_step_reports_and_watching_changes_nothing():
    """One fp8 step of tiny (no remat, one micro-batch: each cast runs once): the weights
    the products report add up to the blocks' matmul weights, the three kinds report, and
    the watched
    program's loss and update are bit-identical to the unwatched one's."""
    cfg, params, batch = setup("tiny")
    init, watched = build_train_step(cfg, Plan(precision="fp8"), KEEP_GRADIENT)
    tally = fp8_watch.Tally()
    with fp8_watch.watching(tally):  # its first trace: the program carries the counts
        state_w, metrics_w = watched(init(params), batch)
    jax.effects_barrier()
    _, step = build_train_step(cfg, Plan(precision="fp8"), KEEP_GRADIENT)  # a new program
    state, metrics = step(init(params), batch)
    assert float(metrics["loss"]) == float(metrics_w["loss"])
    for a, b in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(state_w.opt_state)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    blocks = params["blocks"]
    matmul_weights = sum(blocks[k].size for k in ("wq", "wk", "wv", "wo", "w1", "w2"))
    assert set(tally.sums) == set(fp8_watch.KINDS)
    assert tally.sums["weights"]["elements"] == matmul_weights
    fractions = tally.fractions()
    assert all(fractions[k]["overflow"] == 0 for k in fp8_watch.KINDS)  # current scaling
    # bf16 gradients sit far below E5M2's smallest step unless scaled: most would flush
    assert fractions["gradients"]["unscaled_flushed"] > 0.2 > fractions["gradients"]["flushed"]


def test_watching_is_decided_when_a_program_is_traced():
    """A function traced before the context reports nothing inside it; one traced inside
    keeps reporting after it (JAX caches the trace by function): build steps inside."""
    seen = []
    before = jax.jit(lambda x: fp8.einsum("td,df->tf", x, x.T))
    x = jnp.ones((4, 4))
    before(x)
    with fp8_watch.watching(lambda kind, counts: seen.append(kind)):
        inside = jax.jit(lambda x: fp8.einsum("td,df->tf", x, x.T) * 2)
        inside(x)
        before(x)  # traced before: unchanged
    jax.effects_barrier()
    assert sorted(seen) == ["activations", "weights"]
    inside(x)  # after the context, the program traced inside still reports
    jax.effects_barrier()
    assert sorted(seen) == ["activations", "activations", "weights", "weights"]
