"""sweep: stacked, trimmed batches and learning-rate grids in one compiled function."""
import jax
import numpy as np
import pytest

from jaxscale import garden
from jaxscale.model import optim
from jaxscale.training import sweep
from jaxscale.training.config import TrainConfig
from jaxscale.training.reference import as_arrays, init_run, make_train_step
from jaxscale.model.loss import loss_fn

from conftest import fp32_sum_bound


@pytest.fixture(scope="module")
def setup():
    graphdef, params, _ = init_run(TrainConfig())
    corpus = garden.make_corpus(0)
    return graphdef, params, corpus


@pytest.mark.slow
def test_trimming_padding_columns_keeps_the_loss(setup):
    graphdef, params, corpus = setup
    stacked = sweep.stack_batches(corpus, 4, 8, seed=2)
    it = corpus.train_batches(8, seed=2)
    full = [as_arrays(next(it)) for _ in range(4)]
    t = stacked["tokens"].shape[-1]
    assert t < corpus.seq_len  # something was trimmed...
    assert max(int(np.flatnonzero(b["mask"].any(0))[-1]) for b in full) == t - 1  # ...only padding
    for i, b in enumerate(full):
        assert stacked["mask"][i].sum() == b["mask"].sum()
        trimmed = jax.tree.map(lambda x: x[i], stacked)
        a, c = float(loss_fn(graphdef, params, trimmed)), float(loss_fn(graphdef, params, b))
        # fewer columns, the same n target tokens summed in another order (conftest)
        assert a == pytest.approx(c, rel=fp32_sum_bound(b["mask"].sum()))


def test_validation_stack_counts_every_token_once(setup):
    _, _, corpus = setup
    val = sweep.stack_val(corpus, batch_size=100)  # 512 docs: last batch padded with empties
    assert val["tokens"].shape[:2] == (6, 100)
    assert val["mask"].sum() == sum(len(d) - 1 for d in corpus.val)


@pytest.mark.slow
def test_grid_point_equals_a_plain_training_run(setup):
    """Run k of a vmapped sweep vs the step-by-step train step at the same learning rate."""
    graphdef, params, corpus = setup
    batches = sweep.stack_batches(corpus, 8, 8, seed=1)
    val = sweep.stack_val(corpus)
    lrs = [1e-3, 1e-2]
    res = sweep.run_grid(graphdef, lambda lr: optim.adam(lr), lrs, params, batches, val)
    assert res["losses"].shape == (2, 8) and res["val_loss"].shape == (2,)
    opt = optim.adam(1e-2)
    step, p, s = make_train_step(graphdef, opt), params, opt.init(params)
    losses = []
    for i in range(8):
        p, s, m = step(p, s, jax.tree.map(lambda x: x[i], batches))
        losses.append(float(m["loss"]))
    # vmap batches the matmuls, which may sum in another order: equal to rounding
    np.testing.assert_allclose(res["losses"][1], losses, rtol=1e-5)
    assert res["losses"][0, -1] > res["losses"][1, -1]  # the larger lr learned faster here
