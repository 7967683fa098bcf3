"""Several processes without starting any: placement, options, the sampler, process-local
rows, and one gradient reduction per step under accumulation."""
import argparse
import warnings
from dataclasses import dataclass

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxscale.runtime import processes as D
from jaxscale import garden
from jaxscale.measure import hlo as measure
from jaxscale.data.sampler import Sampler, StepBatches, rows_held
from jaxscale.runtime.mesh import MeshShape, make_mesh

from conftest import setup
from jaxscale.runtime import mesh as meshlib


@dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int


def fake_devices(processes, per_process):
    """Ids as JAX numbers them across processes: 0..K-1, then 2048.., 4096.., ..."""
    return [FakeDevice(2048 * p + i, p) for p in range(processes) for i in range(per_process)]


def _where(dp="in", pp="in", tp="in"):  # cp and ep are 1 in these shapes: in-process
    return {"dp": f"{dp}-process", "ep": "in-process", "pp": f"{pp}-process",
            "cp": "in-process", "tp": f"{tp}-process"}


@pytest.mark.parametrize("p,k,shape,expect", [
    (2, 4, MeshShape(dp=8), _where(dp="cross")),
    (2, 4, MeshShape(dp=2, tp=4), _where(dp="cross")),
    (2, 4, MeshShape(dp=2, pp=2, tp=2), _where(dp="cross")),
    (4, 2, MeshShape(dp=2, pp=2, tp=2), _where(dp="cross", pp="cross")),
    (4, 2, MeshShape(pp=4, tp=2), _where(pp="cross")),
    (8, 1, MeshShape(dp=8), _where(dp="cross")),
])
def test_tp_stays_inside_a_process_then_pp_and_dp_spans_processes(p, k, shape, expect):
    devs = fake_devices(p, k)[::-1]  # any order in, placed by process
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # these all place without a warning
        grid = meshlib.place_devices(devs, shape)
    assert grid.shape == (shape.dp, shape.ep, shape.pp, shape.cp, shape.tp)
    assert meshlib.axis_locality(grid) == expect
    # each process's devices form a contiguous block of the flat order
    procs = [d.process_index for d in grid.flat]
    assert procs == sorted(procs)


def test_a_tp_group_wider_than_a_process_is_placed_with_a_warning():
    with pytest.warns(UserWarning, match="tp=4 does not fit inside one process"):
        grid = meshlib.place_devices(fake_devices(4, 2), MeshShape(dp=2, tp=4))
    assert meshlib.axis_locality(grid)["tp"] == "cross-process"


def test_one_process_keeps_the_order_it_is_given(devices):
    mesh = make_mesh("dp=2,tp=4", devices[::-1])
    assert [d.id for d in mesh.devices.flat] == [d.id for d in devices[::-1]]
    assert meshlib.device_process(mesh) == [0] * 8


def _args(**kw):
    base = dict(coordinator=None, num_processes=None, process_id=None,
                heartbeat_timeout=D.HEARTBEAT_S, shutdown_timeout=D.SHUTDOWN_S)
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("kw,message", [
    (dict(coordinator="127.0.0.1:1234"), "missing --num-processes, --process-id"),
    (dict(coordinator="localhost", num_processes=2, process_id=0), "HOST:PORT"),
    (dict(coordinator="h:70000", num_processes=2, process_id=0), "port 1-65535"),
    (dict(coordinator="h:1234", num_processes=2, process_id=2), "use 0 to 1"),
])
def test_bad_multi_process_options_are_named(kw, message):
    with pytest.raises(D.DistributedError, match=message):
        D.from_args(_args(**kw))


def test_options_make_a_cluster_and_none_make_one_process(monkeypatch):
    c = D.from_args(_args(coordinator="10.0.0.1:9876", num_processes=4, process_id=3,
                          heartbeat_timeout=5))
    assert c == D.Cluster("10.0.0.1:9876", 4, 3, 5, D.SHUTDOWN_S)
    monkeypatch.setenv(D.DETECT_ENV, "off")
    assert D.from_args(_args()) is None
    with pytest.raises(D.DistributedError, match="does not split evenly over 3 processes"):
        D.local_device_count(D.Cluster("h:1", 3, 0), 8)
    assert D.local_device_count(D.Cluster("h:1", 2, 0), 8) == 4


def test_a_slurm_job_is_detected_unless_switched_off(monkeypatch):
    for k, v in {"SLURM_JOB_ID": "1", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NTASKS": "2",
                 "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv(D.DETECT_ENV, raising=False)
    assert D.detected_cluster() == "slurm"
    assert D.from_args(_args()) == D.Cluster(None, None, None)
    monkeypatch.setenv(D.DETECT_ENV, "off")
    assert D.detected_cluster() is None


# --- the sampler ---------------------------------------------------------------------------

def test_every_epoch_is_a_new_shuffle_that_every_process_agrees_on():
    a, b = Sampler(100, seed=7), Sampler(100, seed=7)  # two processes, no shared state
    e0, e1 = a.docs(0, 100), a.docs(100, 200)
    assert sorted(e0) == sorted(e1) == list(range(100))  # each epoch: every document once
    assert not np.array_equal(e0, e1)  # the `set_epoch` trap: epoch 1 is not epoch 0 again
    assert np.array_equal(b.docs(150, 250), a.docs(150, 250))  # any window, any process
    assert np.array_equal(Sampler(100, 7).docs(95, 105), np.r_[e0[95:], e1[:5]])
    assert not np.array_equal(Sampler(100, 8).docs(0, 100), e0)


def test_the_data_position_is_a_global_sample_index_whatever_the_batch():
    corpus = garden.make_corpus(0)
    big = StepBatches(corpus.train, 32, 64, seed=1)
    small = StepBatches(corpus.train, 8, 64, seed=1)
    assert big.position(3) == small.position(12) == 96  # the same sample: resumable anywhere
    assert np.array_equal(big.rows(3, 0, 8)["tokens"], small.rows(12, 0, 8)["tokens"])


def test_a_placed_batch_equals_the_whole_batch_bit_for_bit(devices):
    corpus = garden.make_corpus(0)
    data = StepBatches(corpus.train, 32, 64, seed=1, record=True)
    whole = garden.make_batch([corpus.train[i] for i in data.sampler.docs(64, 96)], 64)
    mesh = make_mesh("dp=4,tp=2", devices)
    sharding = NamedSharding(mesh, P("dp"))
    assert rows_held(sharding, 32) == (0, 32)  # one process holds every row
    placed = data.place(2, sharding)
    assert placed["tokens"].sharding == sharding
    for k in ("tokens", "targets", "mask"):
        assert np.array_equal(np.asarray(placed[k]), getattr(whole, k))
    assert data.n_tokens(2) == whole.n_tokens
    assert data.touched == list(range(64, 96))


class _Sharding:
    """What rows_held reads of a sharding: this process's devices and their rows."""

    def __init__(self, spans):
        self.spans = spans

    def addressable_devices_indices_map(self, shape):
        return {i: (slice(lo, hi), slice(None)) for i, (lo, hi) in enumerate(self.spans)}


def test_a_process_builds_only_the_rows_its_devices_hold():
    data = StepBatches(garden.make_corpus(0).train, 32, 64, seed=1, record=True)
    assert rows_held(_Sharding([(16, 24), (24, 32)]), 32) == (16, 32)
    assert rows_held(_Sharding([(8, 16), (8, 16)]), 32) == (8, 16)  # tp replicas: once
    data.rows(5, 16, 32)
    assert data.touched == list(range(5 * 32 + 16, 6 * 32))


# --- no_sync: accumulation keeps one gradient reduction per step --------------------------

@pytest.mark.slow
def test_gradient_accumulation_reduces_once_per_step(devices):
    """The HLO of dp=8 with 4 micro-batches sends exactly the bytes of dp=8 with 1: the
    all-reduce runs once, after the accumulation loop (PyTorch needs `no_sync` for it)."""
    from jaxscale.model import optim
    from jaxscale.parallel.plan import Plan
    from jaxscale.parallel.build import build_train_step
    cfg, params, batch = setup("tiny")
    sent = {}
    for m in (1, 4):
        init, step = build_train_step(cfg, Plan(dp=8, micro_batches=m), optim.adamw(3e-3),
                                      devices)
        state = init(params)
        hlo = step.jitted.lower(state, step.place_batch(batch)).as_text(dialect="hlo")
        sent[m] = measure.ring_bytes_by_op(hlo)
        loops = [c for c in measure.collectives(hlo) if c.op == "all-reduce" and c.times > 1]
        assert not [c for c in loops if any(len(d) for _, d in c.shapes)], m
    assert sent[4] == sent[1]
    assert jax.tree.leaves(sent[1])


def test_a_job_of_forced_cpu_devices_starts_no_accelerator():
    """processes.start with forced CPU devices sets JAX's platforms to the CPU, so that a
    machine with a GPU or libtpu installed builds its meshes over the forced devices, as
    --platform cpu does (the suite's own JAX_PLATFORMS=cpu is taken away here)."""
    from conftest import run_python
    code = ("import os; os.environ.pop('JAX_PLATFORMS', None)\n"
            "import jax\n"
            "from jaxscale.runtime import processes\n"
            "jax.distributed.initialize = lambda *a, **k: None  # no coordinator needed\n"
            "processes.start(processes.Cluster('127.0.0.1:1', 2, 0), 8)\n"
            "print(jax.config.jax_platforms, len(jax.devices()), jax.devices()[0].platform)\n")
    r = run_python(code)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["cpu", "4", "cpu"]
