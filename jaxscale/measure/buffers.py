"""What fills a compiled program's memory at its peak: XLA's buffer assignment, read back.

XLA places every value of a compiled program in an allocation: one per parameter, the
outputs, the constants, and one heap of temporaries whose layout its heap simulator packs.
For each allocation it records the values live at that allocation's peak (the list XLA's
own out-of-memory reports print as "peak buffers"). jax hands the whole assignment back,
serialised, with the compiled program (`memory_analysis().serialized_buffer_assignment_proto`),
and the optimised HLO module beside it, so nothing is dumped and nothing recompiled (a
program loaded from the compilation cache carries the same bytes).

The two messages are XLA's BufferAssignmentProto and HloModuleProto (xla/service/hlo.proto).
jax ships no Python classes for them, so they are read by field number with protobuf's own
reader of unknown fields; the numbers of a .proto are its wire contract and never change:

  BufferAssignmentProto  1 logical buffers (1 id, 2 size, 3 defined at: 4 instruction id,
                           3 shape index), 3 allocations (1 index, 3 thread-local,
                           5 entry parameter, 6 parameter number, 7 live out, 9 assigned:
                           1 buffer id, 3 size; 12 constant), 5 peak buffers (1 allocation,
                           2 buffer ids)
  HloModuleProto         3 computations (2 instructions: 1 name, 2 opcode, 3 shape,
                           7 metadata: 2 op_name, 15 stack frame; 35 id), 17 stack frames
  ShapeProto             2 element type, 3 dimensions, 4 tuple shapes

Each row: bytes, shape, the instruction that defines the value, jax's op_name for it (the
name stack: jit(step)/transpose(jvp(loss))/... says forward, backward, which layer) and the
source line, and the allocation's kind. Summed by kind, the rows equal memory_analysis()'s
argument, output and temporary sizes (tests/measure/test_buffers.py); the temporaries'
rows are what is live together at the heap's peak.
"""
from __future__ import annotations

from collections import defaultdict

from google.protobuf import empty_pb2
from google.protobuf.unknown_fields import UnknownFieldSet

# xla_data.proto's PrimitiveType, as HLO text writes them
DTYPES = {1: "pred", 2: "s8", 3: "s16", 4: "s32", 5: "s64", 6: "u8", 7: "u16", 8: "u32",
          9: "u64", 10: "f16", 11: "f32", 12: "f64", 13: "tuple", 15: "c64", 16: "bf16",
          17: "token", 18: "c128", 19: "f8e5m2", 20: "f8e4m3fn"}


def fields(data: bytes) -> dict[int, list]:
    """A serialised message's fields by number: ints, or bytes for nested messages."""
    message = empty_pb2.Empty()
    message.ParseFromString(data)
    out = defaultdict(list)
    for f in UnknownFieldSet(message):
        out[f.field_number].append(f.data)
    return out


def _ints(values: list) -> list[int]:
    """A repeated integer field, packed (one bytes value) or not."""
    out = []
    for v in values:
        if isinstance(v, int):
            out.append(v)
            continue
        i = 0
        while i < len(v):  # varints
            n = shift = 0
            while True:
                n |= (v[i] & 0x7F) << shift
                shift, i = shift + 7, i + 1
                if v[i - 1] < 0x80:
                    break
            out.append(n)
    return out


def _first(f: dict, n: int, default=0):
    return f[n][0] if f.get(n) else default


def _text(f: dict, n: int) -> str:
    return _first(f, n, b"").decode("utf-8", "replace")


def shape_text(shape: bytes, index: tuple = ()) -> str:
    """A ShapeProto (or the part at a tuple index) as HLO writes it: f32[256,512]."""
    f = fields(shape)
    for i in index:
        f = fields(f[4][i])
    kind = _first(f, 2)
    if kind == 13:
        return "(" + ", ".join(shape_text(t) for t in f.get(4, [])) + ")"
    return f"{DTYPES.get(kind, f'type{kind}')}[{','.join(map(str, _ints(f.get(3, []))))}]"


def _sources(module: dict):
    """The module's stack frames: frame id -> 'file:line (function)' of its innermost call."""
    index = fields(_first(module, 17, b""))
    files = [x.decode() for x in index.get(1, [])]
    functions = [x.decode() for x in index.get(2, [])]
    places = [fields(x) for x in index.get(3, [])]
    frames = [fields(x) for x in index.get(4, [])]

    def source(frame: int) -> str:
        if not 0 < frame <= len(frames):
            return ""
        place = places[_first(frames[frame - 1], 1) - 1]
        fn = _first(place, 2)
        return (f"{files[_first(place, 1) - 1]}:{_first(place, 3)}"
                + (f" ({functions[fn - 1]})" if fn else ""))
    return source


def instructions(module_bytes: bytes) -> dict[int, dict]:
    """Every instruction of an HloModuleProto by id: name, opcode, shape, op_name, source."""
    module = fields(module_bytes)
    source = _sources(module)
    out = {}
    for computation in module.get(3, []):
        for raw in fields(computation).get(2, []):
            ins = fields(raw)
            meta = fields(_first(ins, 7, b""))
            out[_first(ins, 35)] = {"name": _text(ins, 1), "opcode": _text(ins, 2),
                                    "shape": _first(ins, 3, b""), "op_name": _text(meta, 2),
                                    "source": source(_first(meta, 15))}
    return out


def _kind(allocation: dict) -> str:
    if _first(allocation, 5):
        return "argument"
    if _first(allocation, 12):
        return "constant"
    if _first(allocation, 3):
        return "thread-local"
    return "output" if _first(allocation, 7) else "temporary"


def peak_buffers(compiled) -> list[dict]:
    """The values live at each allocation's peak in a jax Compiled program (module
    docstring), largest first."""
    analysis = compiled.memory_analysis()
    assignment = fields(analysis.serialized_buffer_assignment_proto or b"")
    if not assignment.get(5):  # kept back (XLA:TPU), or a jaxlib without peak buffers
        return []
    module = compiled.runtime_executable().hlo_modules()[0]
    known = instructions(module.as_serialized_hlo_module_proto())
    buffers = {}
    for raw in assignment.get(1, []):
        b = fields(raw)
        at = fields(_first(b, 3, b""))
        buffers[_first(b, 1)] = (_first(b, 2), _first(at, 4), tuple(_ints(at.get(3, []))))
    allocations = {}
    for raw in assignment.get(3, []):
        a = fields(raw)
        sizes = {_first(s, 1): _first(s, 3) for s in map(fields, a.get(9, []))}
        allocations[_first(a, 1)] = (_kind(a), sizes)
    rows = []
    for raw in assignment.get(5, []):
        peak = fields(raw)
        kind, sizes = allocations[_first(peak, 1)]
        for buffer in _ints(peak.get(2, [])):
            size, defined_by, index = buffers[buffer]
            ins = known.get(defined_by, {})
            rows.append({"bytes": sizes.get(buffer, size), "kind": kind,
                         "shape": shape_text(ins["shape"], index) if ins else "?",
                         "instruction": ins.get("name", f"#{defined_by}") +
                         ("{" + ",".join(map(str, index)) + "}" if index else ""),
                         "opcode": ins.get("opcode", ""), "op_name": ins.get("op_name", ""),
                         "source": ins.get("source", "")})
    return sorted(rows, key=lambda r: (-r["bytes"], r["instruction"]))


def by_kind(rows: list[dict]) -> dict[str, int]:
    """The rows' bytes summed by allocation kind."""
    out: dict[str, int] = defaultdict(int)
    for r in rows:
        out[r["kind"]] += r["bytes"]
    return dict(out)
