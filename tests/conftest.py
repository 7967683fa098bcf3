"""Test set-up: 8 forced host-CPU devices for the whole session, and a persistent XLA cache.

The device count is fixed here, before any test imports or runs JAX code, and asserted.
Single-device tests do not see the other devices: a plain jax.jit places everything on
device 0 (test_train checks that). Tests that need a *different* device count, or a fresh
backend, run in a subprocess (see `run_python`).
"""
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from jaxscale.devices import force_cpu_devices

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "jax-tests"
N_DEVICES = 8

jax.config.update("jax_compilation_cache_dir", str(CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
DEVICES = force_cpu_devices(N_DEVICES)
assert len(jax.devices()) == N_DEVICES, jax.devices()


def run_python(code: str, *args: str, env: dict | None = None, timeout: int = 300):
    """Run `python -c code` in a fresh process (fresh JAX backend) from the repo root."""
    full_env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    full_env.update({"JAXSCALE_CACHE_DIR": str(CACHE)}, **(env or {}))
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def devices():
    return DEVICES
