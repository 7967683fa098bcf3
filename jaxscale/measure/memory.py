"""Per-device memory: XLA's analysis of a compiled program (and what a chip must hold to
run it, or the compiler's refusal), and the bytes of a tree of (sharded) arrays that live
on one device."""
from __future__ import annotations

import re

import jax

# the compiler's refusal is read where a kept one is raised again (runtime ranks below us);
# callers read it here, beside the memory figures it stands in for
from jaxscale.runtime.target_cache import refusal  # noqa: F401


def memory(compiled) -> dict[str, int]:
    """Per-device bytes of a compiled program, from XLA's memory analysis."""
    m = compiled.memory_analysis()
    return {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
            "temporaries": m.temp_size_in_bytes, "aliased": m.alias_size_in_bytes,
            "peak": getattr(m, "peak_memory_in_bytes", 0)}


def needed_bytes(compiled, mem: dict | None = None) -> tuple[int, int]:
    """(what a chip must hold to run the program, its generated code): the arguments, the
    outputs not aliased to them, the temporaries and the code (`mem`: memory(compiled))."""
    mem = mem or memory(compiled)
    code = int(getattr(compiled.memory_analysis(), "generated_code_size_in_bytes", 0))
    return mem["arguments"] + mem["outputs"] - mem["aliased"] + mem["temporaries"] + code, code


def bytes_on_device(tree, device, arrays_only: bool = True) -> int:
    """Bytes of a tree of (sharded) arrays that live on `device` (scalars left out unless
    arrays_only=False)."""
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "addressable_shards")
               and (x.ndim or not arrays_only)
               for s in x.addressable_shards if s.device == device)


def refused_bytes(why: str) -> dict:
    """The figures in XLA:TPU's refusal ("the total memory required for HLO temporaries
    (33.52G) exceeds available HBM (31.25G)", G = GiB): what the program needs in all and
    what the chip offers it; None where the sentence has other words. Despite its wording
    the first figure is the whole program's: a 32 GiB argument alone is refused as "HLO
    temporaries (32.00G)", and an 8 GiB argument with 12 GiB of temporaries as 20.00G
    (measured with libtpu for a v5e chip)."""
    m = re.search(r"\((?P<need>[\d.]+)G\) exceeds available HBM \((?P<have>[\d.]+)G\)", why)
    return {"refused_needed_bytes": m and float(m["need"]) * 2**30,
            "refused_available_bytes": m and float(m["have"]) * 2**30}
