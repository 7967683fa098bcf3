"""Reading an optimized program's collectives (jaxscale.measure.hlo_parse): XLA:TPU writes
tiled layouts with parentheses inside the types, async pairs whose -start type holds the
operands and contexts beside the result, and tuples that fold scalars into a gradients'
all-reduce. Lines in the form XLA:TPU printed them for a compare --abstract --target run."""
from jaxscale.measure import hlo, hlo_parse

PERMUTE = ("  %collective-permute-start.1 = (f32[4,64,32]{1,2,0:T(8,128)S(1)}, "
           "f32[4,64,32]{1,2,0:T(8,128)S(1)}, u32[]{:S(2)}, u32[]{:S(2)}) "
           "collective-permute-start(%get-tuple-element.2847), channel_id=1, "
           "source_target_pairs={{1,0},{0,1},{3,2},{2,3}}")
GATHER = ("  %all-gather-start = ((bf16[1,64]{1,0:T(2,128)(2,1)}, bf16[1,32]{1,0:T(2,128)(2,1)}),"
          " (bf16[4,64]{1,0:T(4,128)(2,1)}, bf16[4,32]{1,0:T(4,128)(2,1)})) "
          "all-gather-start(%a, %b), channel_id=2, replica_groups={{0,1,2,3}}, dimensions={0}")
REDUCE = ("  %all-reduce-start = (f32[3232]{0:T(1024)}, f32[]{:T(128)}) all-reduce-start("
          "%g, %loss), channel_id=3, replica_groups={{0,2},{1,3}}, to_apply=%add")
DONE = "  %all-reduce-done = (f32[3232]{0:T(1024)}, f32[]{:T(128)}) all-reduce-done(%all-reduce-start)"
NOT_ONE = '  %fusion.3 = f32[8]{0} fusion(%p), kind=kLoop, metadata={op_name="all-reduce(x)"}'


def test_an_async_starts_result_is_its_output_not_its_operands_and_contexts():
    assert hlo_parse.collective_result(PERMUTE) == (
        "collective-permute", "f32[4,64,32]{1,2,0:T(8,128)S(1)}")
    op, result = hlo_parse.collective_result(GATHER)
    assert op == "all-gather" and result.startswith("(bf16[4,64]") and "bf16[4,32]" in result
    op, result = hlo_parse.collective_result(REDUCE)  # all-reduce-start: its type is its result
    assert op == "all-reduce" and result.startswith("(f32[3232]") and "f32[]" in result


def test_a_done_and_a_mention_in_metadata_are_not_collectives():
    assert hlo_parse.collective_result(DONE) is None
    assert hlo_parse.collective_result(NOT_ONE) is None


def test_bytes_of_an_optimized_program_by_axis():
    """On a dp=2 x tp=2 mesh: the permute's 4*64*32 fp32 once (its operand and contexts not
    counted), the gather's two outputs over 4 devices, the reduce over dp without the loss
    folded into it (tensor_bytes)."""
    ops = hlo.collectives("\n".join([PERMUTE, GATHER, REDUCE, DONE, NOT_ONE]))
    assert [c.op for c in ops] == ["collective-permute", "all-gather", "all-reduce"]
    assert ops[0].nbytes == 4 * 64 * 32 * 4
    assert ops[1].nbytes == (4 * 64 + 4 * 32) * 2
    assert (ops[2].nbytes, ops[2].tensor_bytes) == (3232 * 4 + 4, 3232 * 4)
    sent = hlo.ring_bytes_by_axis("\n".join([PERMUTE, GATHER, REDUCE]), {"dp": 2, "tp": 2})
    assert sent == {"tp": {"collective-permute": 4 * 64 * 32 * 4},
                    "dp+tp": {"all-gather": 3 / 4 * (4 * 64 + 4 * 32) * 2},
                    "dp": {"all-reduce": 2 * 1 / 2 * 3232 * 4}}
