"""Counting what FP8 casts do (jaxscale.model.fp8_watch): the counts are those of ml_dtypes's
cast, every product of a training step reports, and watching changes no number."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxscale.model import fp8, fp8_watch, formats
from jaxscale.parallel.build import build_train_step
from jaxscale.parallel.plan import Plan

from conftest import KEEP_GRADIENT, setup


def test_tally_counts_what_ml_dtypes_makes_of_each_value():
    """The counts against formats.classify of the scaled values (ml_dtypes's cast): flushed,
    subnormal; overflow only past the largest value's rounding half step (464 for E4M3)."""
    x = jnp.asarray(np.concatenate([np.random.default_rng(0).standard_normal(4000) * 1e-2,
                                    [0.0, 463.0, 465.0, 7e4, 9e-4, 1e-3]]), jnp.float32)
    for fmt, name in ((fp8.E4M3, "float8_e4m3fn"), (fp8.E5M2, "float8_e5m2")):
        q = jnp.clip(x, -fp8.LARGEST[fmt], fp8.LARGEST[fmt]).astype(fmt)
        counts = dict(zip(fp8_watch.COUNTS, np.asarray(fp8_watch.tally(x, x, q, fmt))))
        ref = formats.classify(np.asarray(x), name)
        n = x.size
        assert counts["elements"] == n and counts["nonzero"] == n - 1
        assert counts["flushed"] == round(ref["flushed"] * n)
        # ml_dtypes makes an E4M3 value past 464 NaN (no inf): classify's "overflow"
        over = np.asarray(x).astype(getattr(ml_dtypes, name)).astype(np.float32)
        assert counts["overflow"] == np.sum(~np.isfinite(over) | (np.abs(over) > fp8.LARGEST[fmt]))
        assert counts["overflow"] == (2 if fmt == fp8.E4M3 else 1)  # 465 and 7e4; 7e4 only
        sub = np.asarray(q.astype(jnp.float32))
        assert counts["subnormal"] == np.sum((sub != 0) & (np.abs(sub) < ref_normal(name)))
        assert counts["unscaled_flushed"] == counts["flushed"]  # here x s = x


def ref_normal(name):
    return float(ml_dtypes.finfo(getattr(ml_dtypes, name)).smallest_normal)


def test_every_product_of_a_step_reports_and_watching_changes_nothing():
    """One fp8 step of tiny: the weights each product reports add up to the blocks' matmul
    weights (every product is watched, once), the three kinds all report, and the watched
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


def test_only_programs_traced_inside_are_watched():
    seen = []
    f = jax.jit(lambda x: fp8.einsum("td,df->tf", x, x.T))
    x = jnp.ones((4, 4))
    f(x)
    with fp8_watch.watching(lambda kind, counts: seen.append(kind)):
        jax.jit(lambda x: fp8.einsum("td,df->tf", x, x.T))(x)
        f(x)  # compiled before: unchanged
    jax.effects_barrier()
    assert sorted(seen) == ["activations", "weights"]
