"""jaxscale.runtime.profiling: traces written where they should be, and read back sensibly.

Small jitted functions stand in for a training step: a matmul + tanh on one device, and a
psum over 2 of the 8 forced CPU devices (a collective shows up as an op on each device).
"""
import time
from functools import partial

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxscale.runtime.profiling import RUNS, OpTime, Profiler, step_times, top_ops

N_STEPS = 3


@pytest.fixture(scope="module")
def work():
    """One 'step': matmul + tanh on device 0, then a psum over devices 0 and 1; compiled."""
    mesh = jax.make_mesh((2,), ("d",), devices=jax.devices()[:2])
    x = jnp.ones((128, 128))
    y = jax.device_put(jnp.ones((128, 128)), NamedSharding(mesh, P("d")))

    @jax.jit
    def dense(x):
        return jnp.tanh(x @ x)

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=P("d"), out_specs=P())
    def reduce(y):
        return jax.lax.psum(jnp.tanh(y @ y.T).sum(0), "d")  # [64,128] each -> [128] summed

    def step():
        jax.block_until_ready((dense(x), reduce(y)))

    step()  # compile outside any trace
    return step


@pytest.fixture(scope="module")
def traced(work, tmp_path_factory):
    """A Profiler's directory after N_STEPS annotated steps, the files stop() returned and
    the steps' times by the test's own clock (ms)."""
    directory = tmp_path_factory.mktemp("profile") / "run"  # not there yet: created
    prof = Profiler(directory)
    wall = []
    with prof.trace():
        for i in range(N_STEPS):
            t = time.perf_counter()
            with prof.step(i):
                work()
            wall.append((time.perf_counter() - t) * 1e3)
    return directory, prof.files, wall


def test_trace_files_lie_in_the_tensorboard_layout(traced):
    directory, files, _ = traced
    (run,) = (directory / RUNS).iterdir()
    assert sorted(files) == sorted(run.iterdir())
    names = {f.name for f in files}
    assert "perfetto_trace.json.gz" in names
    assert any(n.endswith(".xplane.pb") for n in names)
    assert any(n.endswith(".trace.json.gz") and n != "perfetto_trace.json.gz" for n in names)


def test_top_ops_names_the_matmul_and_the_collective(traced):
    directory, _, _ = traced
    ops = top_ops(directory, n=1000)
    assert ops and all(isinstance(o, OpTime) for o in ops)
    assert all(o.name and o.total_ms > 0 and o.count > 0 for o in ops)
    assert sum(o.share for o in ops) == pytest.approx(1.0)
    assert [o.total_ms for o in ops] == sorted((o.total_ms for o in ops), reverse=True)
    # the psum runs once per device per step, each device's event its own
    (psum,) = [o for o in ops if o.name.startswith(("psum", "all-reduce"))]
    assert psum.count == 2 * N_STEPS
    assert len(top_ops(directory, n=2)) == 2


def test_step_times_match_the_annotated_steps(traced):
    directory, _, wall = traced
    times = step_times(directory)
    assert len(times) == N_STEPS
    assert all(0 < t <= w + 1.0 for t, w in zip(times, wall))  # inside the caller's timer


def test_disabled_profiler_does_nothing(tmp_path, work):
    prof = Profiler(None)
    assert not prof.enabled
    with prof.trace():
        with prof.step(0):
            work()
    prof.start()
    assert prof.stop() == []
    assert list(tmp_path.iterdir()) == []


def test_an_error_inside_stops_the_trace_and_a_new_one_can_start(tmp_path, work):
    prof = Profiler(tmp_path)
    with pytest.raises(ZeroDivisionError):
        with prof.trace():
            with prof.step(0):
                work()
                1 / 0
    assert not prof.running
    assert step_times(tmp_path) and top_ops(tmp_path)  # the first trace was written whole
    with prof.trace():  # JAX's one-trace-at-a-time slot is free again; same second or not,
        work()          # the first trace's folder is kept
    assert len(list((tmp_path / RUNS).iterdir())) == 2
    assert step_times(tmp_path) == []  # the newest trace is read: no step annotations


def test_the_bodys_error_propagates_when_the_stop_fails_too(tmp_path, monkeypatch):
    """A body that raises, then a trace that cannot be written: the body's error is the one
    the caller sees (before: the stop's RuntimeError from `finally` replaced it)."""
    prof, real_stop = Profiler(tmp_path), jax.profiler.stop_trace

    def unwritable():
        real_stop()  # JAX's one trace slot is freed; the writing is what "fails"
        raise OSError("no space left on device")
    monkeypatch.setattr(jax.profiler, "stop_trace", unwritable)
    with pytest.raises(ZeroDivisionError):
        with prof.trace():
            1 / 0
    assert not prof.running
    with pytest.raises(RuntimeError, match="was not written: no space"):
        with prof.trace():  # with no error of its own, the stop's error is raised
            pass


def test_one_trace_at_a_time(tmp_path, work):
    first, second = Profiler(tmp_path / "a"), Profiler(tmp_path / "b")
    with first.trace():
        with pytest.raises(RuntimeError, match="cannot start a trace into .*b"):
            second.start()
    with pytest.raises(RuntimeError, match="stop.. without start"):
        first.stop()


def test_bad_directories_are_named(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ValueError, match="afile exists and is not a directory"):
        Profiler(afile)
    with pytest.raises(ValueError, match="afile/sub cannot be created"):
        Profiler(afile / "sub")


def test_nothing_readable_reads_as_none(tmp_path):
    assert top_ops(tmp_path) is None and step_times(tmp_path) is None
    assert top_ops(tmp_path / "missing") is None
    (tmp_path / "broken.xplane.pb").write_bytes(b"\xff not a protobuf \xff" * 4)
    assert top_ops(tmp_path) is None and step_times(tmp_path) is None
