"""The state as Orbax sees it: a flat dict of named tensors, each with a digest beside it.

A TrainState is saved as one Orbax item per tensor, named by its dotted path in the tree
("opt_state.0.mu.blocks.wq"); beside each goes a 32-bit digest item (`DIGEST` + name)
computed on the devices, so that a file that reads back as zeros, or not at all, is caught
on restore (jaxscale.training.checkpoint.manager). `read_canonical` reads the tensors of a
checkpoint back by name, onto one device, for tests and tools.
"""
from __future__ import annotations

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
