"""The state as Orbax sees it: a flat dict of named tensors, each with a digest beside it.

A TrainState is saved as one Orbax item per tensor, named by its dotted path in the tree
("opt_state.0.mu.blocks.wq"); beside each goes a 32-bit digest item (`DIGEST` + name)
computed on the devices, so that a file that reads back as zeros, or not at all, is caught
on restore (jaxscale.training.checkpoint.manager). `read_canonical` reads the tensors of a
checkpoint back by name, onto one device, for tests and tools.

Orbax writes a tensor held whole by several devices (replicated over dp, say) in slices,
one per replica, each cut out on its device by an eager slice: a dispatch per replica and
tensor, and for a new shape a compile. For tensors of a few kilobytes that costs far more
than the writing: the first save of a 3-D run of `tiny` took 5.0 s, 1.2 s without the
slicing, and each later save 0.7 s against 0.5 s; test_checkpoint_resume's every-strategy
test went from 234 s to 197 s (benchmarks/checkpoint_replicas.py: tp=4's first save 0.48x,
dp=8's unchanged within its spread). `use_orbax_array_handler` (called by the Checkpointer)
has one replica write a tensor whose slice per replica would hold under
REPLICA_SLICE_MIN_BYTES; larger tensors are still split over the replicas. The values and
the files' names are the same either way (Orbax's key-value store may cut them into fewer
data files): only who writes them changes.
"""
from __future__ import annotations

import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale.training.checkpoint.store import DIGEST


def _name(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator=".")


def flat_items(tree) -> dict:
    """{dotted path: leaf}, e.g. "opt_state.0.mu.blocks.wq": one Orbax item per tensor."""
    return {_name(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def unflat_items(items: dict, like):
    """The tree of `like` with its leaves taken from items (flat_items' inverse)."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(like)
    return jax.tree_util.tree_unflatten(treedef, [items[_name(p)] for p, _ in paths])


REPLICA_SLICE_MIN_BYTES = 1 << 20
_handler_set = False


def use_orbax_array_handler(ocp) -> None:
    """Orbax's handler for jax.Array with REPLICA_SLICE_MIN_BYTES, registered once per
    process: Orbax keeps one handler per type for every checkpointer in the process, and
    setting options by registering a handler is its own way. Its default handler also keeps
    per-array metadata (a store that is not public API; its options route,
    `register_standard_handlers_with_options`, drops it): kept here, so that the files are
    Orbax's default ones. An Orbax without that module keeps its default handler."""
    global _handler_set
    if _handler_set:
        return
    _handler_set = True
    try:
        from orbax.checkpoint._src.metadata import array_metadata_store as metadata
    except ImportError:  # another Orbax: its own handler, the save is only slower
        return
    handler = ocp.type_handlers.ArrayHandler(
        array_metadata_store=metadata.Store(),
        min_slice_bytes_for_replica_parallel=REPLICA_SLICE_MIN_BYTES)
    absl = logging.getLogger("absl")  # Orbax warns of the override, as of a mistake
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)
    finally:
        absl.setLevel(level)


_OFFSET = 0x9E3779B9  # so that an all-zero tensor and a zero-filled digest never agree


@jax.jit
def digest(items: dict) -> dict:
    """A 32-bit sum of every tensor's bits (plus an offset), on the devices: a file that
    reads back as zeros, or not at all, changes it. Saved as a tensor beside each tensor,
    so that an asynchronous save never waits for it on the host."""
    def bits(x):
        width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
        total = jnp.sum(jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32),
                        dtype=jnp.uint32)
        return total + jnp.uint32(_OFFSET)
    return {DIGEST + k: bits(x) for k, x in items.items()}


def read_canonical(directory, step: int) -> dict:
    """Every tensor of one checkpoint as host arrays, by dotted name (for tests and tools)."""
    import orbax.checkpoint as ocp  # here, not at the top: importing Orbax takes a while

    path = Path(directory).absolute() / str(step) / "state"
    here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    with ocp.StandardCheckpointer() as ckptr:  # onto one device, whatever mesh wrote it
        meta = ckptr.metadata(path)
        tree = getattr(meta, "item_metadata", None) or meta
        target = {k: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=here)
                  for k, m in dict(tree).items()}
        items = ckptr.restore(path, target)
    return {k: np.asarray(v) for k, v in items.items() if not k.startswith(DIGEST)}
