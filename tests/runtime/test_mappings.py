"""The suite's guard on a worker's memory mappings (tests/conftest.py): past the cap, XLA's
loaded programs are dropped, the mappings fall, and a dropped program still runs (loaded
again from the persistent cache or compiled) with the same result."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conftest


@pytest.mark.skipif(not conftest.MAPS.exists(), reason="needs Linux's /proc")
@pytest.mark.slow
def test_past_the_cap_the_loaded_programs_are_dropped_and_still_run():
    @jax.jit
    def f(x):
        for k in range(20):  # 20 sorts: kernels of their own, so mappings of their own
            x = jnp.sort(x * (k + 1), axis=-1) @ x.T
        return x

    x = jnp.arange(64.0).reshape(8, 8) / 64
    before = np.asarray(f(x))
    held = conftest._mappings()
    assert not conftest.drop_programs_past(held + 10_000)  # under the cap: nothing done
    assert conftest.drop_programs_past(held // 2)  # over it: dropped
    assert conftest._mappings() < held
    np.testing.assert_array_equal(np.asarray(f(x)), before)  # max abs diff 0.0
