"""Forcing host-CPU devices and building meshes from spec strings."""
import json
import os

import jax
import pytest

from jaxscale.runtime.devices import DeviceError, force_cpu_devices
from jaxscale.runtime.mesh import MeshShape, MeshSpecError, make_mesh, parse_mesh_spec

from conftest import N_DEVICES, run_python


@pytest.mark.parametrize("spec, shape", [
    ("dp=8", MeshShape(dp=8)),
    ("dp=2,tp=2,pp=2", MeshShape(2, 2, 2)),
    (" tp = 4 , dp=2 ", MeshShape(dp=2, tp=4)),
    ("pp=1", MeshShape()),
])
def test_parse_mesh_spec(spec, shape):
    assert parse_mesh_spec(spec) == shape


@pytest.mark.parametrize("spec, words", [
    ("dp=2,xp=4", ["unknown mesh axis 'xp'", "dp, ep, pp, cp, tp"]),
    ("dp=2,dp=4", ["'dp' given twice"]),
    ("dp=0", ["positive integer", "got 0"]),
    ("dp=-2", ["positive integer", "got -2"]),
    ("dp=2.5", ["positive integer", "'2.5'"]),
    ("dp=two", ["positive integer", "'two'"]),
    ("dp", ["cannot read 'dp'", "AXIS=SIZE"]),
    ("", ["empty mesh spec"]),
])
def test_bad_mesh_specs_name_the_problem(spec, words):
    with pytest.raises(MeshSpecError) as e:
        parse_mesh_spec(spec)
    for w in words:
        assert w in str(e.value)


def test_mesh_over_forced_devices(devices):
    mesh = make_mesh("dp=2,tp=2,pp=2")
    assert mesh.axis_names == ("dp", "ep", "pp", "cp", "tp")
    assert dict(mesh.shape) == {"dp": 2, "ep": 1, "pp": 2, "cp": 1, "tp": 2}
    assert sorted(d.id for d in mesh.devices.flat) == list(range(N_DEVICES))
    # tp is the innermost axis: a tp group is made of neighbouring devices
    assert [d.id for d in mesh.devices[0, 0, 0, 0, :]] == [0, 1]
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_mesh_size_must_match_device_count(devices):
    with pytest.raises(MeshSpecError, match="needs 4 devices but 8 are available"):
        make_mesh("dp=4")
    assert dict(make_mesh("dp=4", devices[:4]).shape)["dp"] == 4


def test_force_after_backend_started_raises_instead_of_ignoring(devices):
    assert len(force_cpu_devices(N_DEVICES)) == N_DEVICES  # same count: fine
    with pytest.raises(DeviceError, match="already started with 8"):
        force_cpu_devices(4)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(DeviceError, match="positive integer"):
            force_cpu_devices(bad)


def test_force_in_fresh_process_and_the_flag_it_replaces():
    """In a fresh process forcing works; the raw XLA flag set too late is silently ignored."""
    code = """
import json, os, jax, jax.numpy as jnp
from jaxscale.runtime.devices import force_cpu_devices, DeviceError
n = len(force_cpu_devices(4))
jnp.zeros(1).block_until_ready()
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"  # too late: ignored
after_flag = len(jax.devices())
try:
    force_cpu_devices(2); err = None
except DeviceError as e:
    err = str(e)
print(json.dumps({"n": n, "after_flag": after_flag, "err": err}))
"""
    r = run_python(code)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["n"] == 4 and out["after_flag"] == 4
    assert "asked for 2 CPU devices" in out["err"] and "already started with 4" in out["err"]


def test_cpu_runtime_threads_cover_every_device():
    """Each of XLA CPU's two pools gets THREADS_PER_DEVICE threads per forced device, so a
    device holding several collectives at once never leaves another without a thread."""
    from jaxscale.runtime.devices import THREADS_PER_DEVICE, cpu_runtime_threads
    cores = os.cpu_count()
    assert cpu_runtime_threads(1) == cores
    assert cpu_runtime_threads(8) == max(cores, THREADS_PER_DEVICE * 8)
    assert THREADS_PER_DEVICE >= 3  # a loop's collective, the next one, the loop itself


def test_forcing_devices_sizes_the_thread_pools_before_the_backend_starts():
    """In a fresh process: PJRT_NPROC is set from the device count (the thread count grows
    by two pools' worth), and a PJRT_NPROC the user set wins."""
    code = """
import json, os, jax, jax.numpy as jnp
from jaxscale.runtime.devices import force_cpu_devices
force_cpu_devices(8)
jnp.ones(3).block_until_ready()
print(json.dumps({"nproc": os.environ["PJRT_NPROC"], "threads": len(os.listdir("/proc/self/task"))}))
"""
    off = {"JAX_COMPILATION_CACHE_DIR": ""}  # the cache's writer threads would count too
    ours = json.loads(run_python(code, env=off).stdout)
    theirs = json.loads(run_python(code, env={**off, "PJRT_NPROC": "8"}).stdout)
    assert ours["nproc"] == str(max(os.cpu_count(), 32)) and theirs["nproc"] == "8"
    assert ours["threads"] - theirs["threads"] == 2 * (int(ours["nproc"]) - 8)  # two pools


def test_too_many_devices_are_refused_before_jax_starts():
    from jaxscale.runtime.devices import MAX_CPU_DEVICES
    with pytest.raises(DeviceError, match=f"at most {MAX_CPU_DEVICES}"):
        force_cpu_devices(MAX_CPU_DEVICES + 1)
    r = run_python("from jaxscale.cli.main import main; import sys; sys.exit(main(sys.argv[1:]))",
                   "train", "--devices", "1000", "--steps", "1", timeout=60)
    assert r.returncode == 2 and "more than this host can run" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
