"""The persistent compilation cache: compiled programs kept on disk between runs.

Compiling dominates a short run on CPU (seconds per program); a warm cache makes a second
run of the same programs about five times faster. The same folder keeps the garden
corpora drawn (`corpora/`, garden.drawn) and what jaxscale read of programs compiled for a
`--target` (`targets/`, runtime.target_cache).
"""
from __future__ import annotations

import os
from pathlib import Path

import jax

from jaxscale.garden import drawn


def enable_compilation_cache() -> None:
    """Keep compiled programs and drawn corpora on disk: in $JAXSCALE_CACHE_DIR ("off":
    nowhere); without it, in the folder JAX is already set to use (JAX_COMPILATION_CACHE_DIR,
    a test suite's cache), else in ~/.cache/jaxscale/xla."""
    cache = os.environ.get("JAXSCALE_CACHE_DIR")
    if cache is None:  # a folder someone already chose for JAX wins over our default
        cache = (jax.config.jax_compilation_cache_dir
                 or str(Path.home() / ".cache" / "jaxscale" / "xla"))
    if cache and cache.lower() != "off":
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        drawn.keep_in(Path(cache) / "corpora")
