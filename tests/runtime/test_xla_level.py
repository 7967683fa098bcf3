"""The suite compiles at XLA:CPU's LLVM optimization level 1 (conftest: SUITE_XLA_FLAGS), to
spend less time compiling. That is only sound while level 1 computes what XLA's default,
level 3, computes: here two training steps of two layouts are compiled at both levels
(compiler_options override the flag for one compile) and must end in the same state, bit
for bit (max abs diff 0.0). A jaxlib whose level 1 rounds differently fails here, by name.
(The option does reach the compiler: the same step at level 0 ends 2.3e-6 away after three
Adam steps, measured with jaxlib 0.10.2.)
"""
import jax
import numpy as np
import optax
import pytest

from conftest import SUITE_XLA_FLAGS, setup
from jaxscale.parallel.build import build_train_step
from jaxscale.parallel.plan import Plan

pytestmark = pytest.mark.slow


def _two_steps(step, state, batch, level: int):
    placed = step.place_batch(batch)
    compiled = step.jitted.lower(state, placed).compile(
        compiler_options={"xla_backend_optimization_level": level})
    for _ in range(2):
        state, metrics = compiled(state, placed)
    return jax.tree.leaves(state), float(metrics["loss"])


@pytest.mark.parametrize("model, plan", [("tiny", {}),
                                         ("tiny8", dict(dp=2, pp=2, tp=2, micro_batches=2,
                                                        zero_stage=1))],
                         ids=["one device", "dp2 pp2 tp2 zero1"])
def test_the_suites_optimization_level_computes_what_the_default_computes(model, plan):
    assert SUITE_XLA_FLAGS == "--xla_backend_optimization_level=1"
    cfg, params, batch = setup(model)
    p = Plan(**plan)
    init, step = build_train_step(cfg, p, optax.adamw(1e-3), jax.devices()[:p.n_devices])
    default, loss3 = _two_steps(step, init(params), batch, 3)
    suite, loss1 = _two_steps(step, init(params), batch, 1)
    assert loss1 == loss3
    assert max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b))))
               for a, b in zip(default, suite)) == 0.0
