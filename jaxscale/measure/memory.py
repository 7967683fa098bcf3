"""Per-device memory: XLA's analysis of a compiled program, and the bytes of a tree of
(sharded) arrays that live on one device."""
from __future__ import annotations

import jax


def memory(compiled) -> dict[str, int]:
    """Per-device bytes of a compiled program, from XLA's memory analysis."""
    m = compiled.memory_analysis()
    return {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
            "temporaries": m.temp_size_in_bytes, "aliased": m.alias_size_in_bytes,
            "peak": getattr(m, "peak_memory_in_bytes", 0)}


def bytes_on_device(tree, device, arrays_only: bool = True) -> int:
    """Bytes of a tree of (sharded) arrays that live on `device` (scalars left out unless
    arrays_only=False)."""
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "addressable_shards")
               and (x.ndim or not arrays_only)
               for s in x.addressable_shards if s.device == device)
