"""Hand-built ring collectives vs XLA's, their byte ledger vs the HLO, and a parameter server."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxscale.parallel import ring as C
from jaxscale.measure import hlo as measure
from jaxscale.runtime.mesh import make_mesh


def on_mesh(fn, k, devices, n=48, dtype=jnp.int32, seed=0):
    """Run fn(local_vector) on a dp=k mesh; each device's input is one row of x [k, n]."""
    mesh = make_mesh(f"dp={k}", devices[:k])
    f = jax.jit(jax.shard_map(lambda x: jax.tree.map(lambda y: y[None], fn(x[0])), mesh=mesh,
                              in_specs=P("dp"), out_specs=P("dp")))
    rng = np.random.default_rng(seed)
    x = (rng.integers(-1000, 1000, (k, n)) if dtype == jnp.int32
         else rng.standard_normal((k, n)) * 10.0 ** rng.integers(-3, 3, (k, n)))
    x = jnp.asarray(x, dtype)
    return f, x


@pytest.mark.parametrize("k", [2, 4, 8])
def test_ring_collectives_equal_xla_exactly_on_integers(devices, k):
    for ours, theirs in [
        (lambda v: C.ring_reduce_scatter(v, "dp"), lambda v: lax.psum_scatter(v, "dp", tiled=True)),
        (lambda v: C.ring_all_gather(v[:6], "dp"), lambda v: lax.all_gather(v[:6], "dp", tiled=True)),
        (lambda v: C.ring_all_reduce(v, "dp"), lambda v: lax.psum(v, "dp")),
        (lambda v: C.parameter_server_all_reduce(v, "dp"), lambda v: lax.psum(v, "dp")),
    ]:
        f, x = on_mesh(lambda v: (ours(v), theirs(v)), k, devices)
        a, b = f(x)
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(f(x)[0][0], np.asarray(x).sum(0))


def test_ring_all_reduce_on_floats_differs_only_in_summation_order(devices):
    """psum adds x0 + x1 + ... ; the ring starts each chunk at another device: a few ulps."""
    f, x = on_mesh(lambda v: (C.ring_all_reduce(v, "dp"), lax.psum(v, "dp")), 8, devices,
                   n=4096, dtype=jnp.float32)
    ring, xla = (np.asarray(y[0]) for y in f(x))
    exact = np.asarray(x, np.float64).sum(0)
    scale = np.abs(np.asarray(x, np.float64)).sum(0)  # rounding error is relative to this
    assert np.max(np.abs(ring - exact) / scale) < 8 * 2**-24
    assert np.max(np.abs(xla - exact) / scale) < 8 * 2**-24
    # all-gather moves values without arithmetic: bit-identical even for floats
    g, x = on_mesh(lambda v: (C.ring_all_gather(v, "dp"), lax.all_gather(v, "dp", tiled=True)),
                   8, devices, dtype=jnp.float32)
    a, b = g(x)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("k", [2, 4, 8])
def test_ledger_matches_formula_and_hlo(devices, k):
    n, itemsize = 96, 4
    ledger = C.Ledger()
    f, x = on_mesh(lambda v: C.ring_all_reduce(v, "dp", ledger), k, devices, n=n)
    hlo = f.lower(x).as_text(dialect="hlo")
    expected = 2 * (k - 1) * (n // k) * itemsize  # = 2(K-1)/K x vector bytes
    assert ledger.sent_per_device() == [expected] * k
    assert ledger.received_per_device() == [expected] * k
    permutes = [c for c in measure.collectives(hlo) if c.op == "collective-permute"]
    assert len(permutes) == 2 * (k - 1)
    assert sum(c.nbytes for c in permutes) == expected
    assert all(sorted(c.pairs) == [(i, (i + 1) % k) for i in range(k)] for c in permutes)


def test_parameter_server_load_grows_linearly_at_device_0(devices):
    n, itemsize = 64, 4
    at_zero = {}
    for k in (2, 4, 8):
        ledger = C.Ledger()
        f, x = on_mesh(lambda v: C.parameter_server_all_reduce(v, "dp", ledger), k, devices, n=n)
        f.lower(x)  # tracing fills the ledger
        sent, received = ledger.sent_per_device(), ledger.received_per_device()
        assert sent[0] == received[0] == (k - 1) * n * itemsize
        assert all(s == n * itemsize for s in sent[1:])
        at_zero[k] = sent[0] + received[0]
    assert at_zero[8] / at_zero[2] == 7  # (K-1) grows linearly; the ring stays at 2(K-1)/K


def test_step_by_step_trace_for_four_devices(devices):
    """The lecture's walkthrough: after reduce-scatter step s, device i holds the sum of
    chunk (i - s - 2) over devices i-s-1 .. i; after K-1 steps, chunk i over all devices."""
    k, n = 4, 8
    def fn(v):
        trace = []
        out = C.ring_all_reduce(v, "dp", trace=trace)
        return out, jnp.stack(trace)
    f, x = on_mesh(fn, k, devices, n=n)
    out, trace = (np.asarray(a) for a in f(x))
    chunks = np.asarray(x).reshape(k, k, n // k)  # [device, chunk, elements]
    assert trace.shape == (k, 2 * (k - 1), n // k)
    for i in range(k):
        for s in range(k - 1):
            c = (i - s - 2) % k
            contributors = [(i - j) % k for j in range(s + 2)]
            np.testing.assert_array_equal(trace[i, s], chunks[contributors, c].sum(0))
        np.testing.assert_array_equal(trace[i, k - 2], chunks[:, i].sum(0))
    np.testing.assert_array_equal(out[0], np.asarray(x).sum(0))


def test_hlo_parser_reads_shapes_and_bytes(devices):
    mesh = make_mesh("dp=8", devices)
    f = jax.jit(jax.shard_map(lambda a, b: (lax.psum(a, "dp"), lax.psum(b, "dp")), mesh=mesh,
                              in_specs=(P("dp"), P("dp")), out_specs=(P(), P())))
    hlo = f.lower(jnp.ones((8, 3, 5)), jnp.ones((8, 7), jnp.bfloat16)).as_text(dialect="hlo")
    ops = measure.bytes_by_op(hlo)
    assert ops["all-reduce"]["bytes"] == 3 * 5 * 4 + 7 * 2
    assert ops["all-reduce"]["count"] in (1, 2)  # one per psum, or one tuple op


def test_length_must_divide_into_chunks(devices):
    with pytest.raises(ValueError, match="not divisible by the axis size 8"):
        f, x = on_mesh(lambda v: C.ring_reduce_scatter(v, "dp"), 8, devices, n=12)
        f(x)
