"""benchmarks/gpu/step_profile.sources: a kernel's HLO instruction -> the model's source lines,
read from the optimized HLO's metadata and its trailing FileNames / FileLocations /
StackFrames tables (the form jax 0.10 / 0.11 print)."""

from benchmarks.gpu.step_profile import instructions, sources, step_key

HLO = """HloModule jit__forward_fn, is_scheduled=true

ENTRY %main {
  %loop_multiply_fusion = bf16[4096,2048]{1,0} fusion(%w, %x), kind=kLoop, calls=%fused_multiply, metadata={op_name="jit(_forward_fn)/jit(<lambda>)/dot_general" stack_frame_id=2}
  %pallas_call.7 = f32[16]{0} custom-call(%a), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(_forward_fn)/pallas_call" stack_frame_id=3}
  ROOT %copy.1 = f32[16]{0} copy(%pallas_call.7), metadata={op_name="copy"}
}

FileNames
1 "/work/main/paxengine/models/quant.py"
2 "/work/main/paxengine/models/qwen3_moe.py"
3 "/work/main/kernels_pallas/attention.py"

FunctionNames
1 "linear"

FileLocations
1 {file_name_id=1 function_name_id=1 line=282 end_line=282 column=11 end_column=20}
2 {file_name_id=2 function_name_id=1 line=268 end_line=268 column=4 end_column=30}
3 {file_name_id=3 function_name_id=1 line=359 end_line=359 column=4 end_column=30}

StackFrames
1 {file_location_id=2 parent_frame_id=1}
2 {file_location_id=1 parent_frame_id=1}
3 {file_location_id=3 parent_frame_id=3}
"""


def test_sources_name_each_kernels_lines_and_caller():
    src = sources(HLO)
    assert (
        src["loop_multiply_fusion"] == "models/quant.py:282 < models/qwen3_moe.py:268 dot_general"
    )
    assert src["pallas_call.7"] == "kernels_pallas/attention.py:359 pallas_call"
    assert src["copy.1"] == "? copy"  # no stack frame


def test_instructions_give_each_kernels_shape_and_kind():
    """A kernel no source line names (cuBLAS, an inserted copy) is told by its shape and kind;
    a tuple result (cuBLAS's workspace beside the product) keeps its parts, layouts dropped."""
    hlo = HLO.replace(
        "ENTRY %main {",
        "ENTRY %main {\n  %custom-call.241 = (bf16[256,4096]{1,0}, s8[4194304]{0}) "
        'custom-call(bf16[256,4096]{1,0} %a), custom_call_target="__cublas$gemm"',
    )
    what = instructions(hlo)
    assert what["custom-call.241"] == "(bf16[256,4096], s8[4194304]) custom-call __cublas$gemm"
    assert what["loop_multiply_fusion"] == "bf16[4096,2048] fusion fused_multiply"
    assert what["pallas_call.7"] == "f32[16] custom-call __gpu$xla.gpu.triton"
    assert what["copy.1"] == "f32[16] copy"


def test_step_key_is_the_smallest_bucket_that_holds_the_batch():
    compiled = {(1, 8): 0, (64, 8): 0, (64, 64): 0, (512, 8): 0}
    assert step_key(compiled, 1) == (1, 8)
    assert step_key(compiled, 8) == (64, 8)
    assert step_key(compiled, 100) is None


def test_profile_buckets_pad_each_batch_as_the_engine_does():
    """A profiled batch decodes in the buckets of the GPU defaults' ladders (300 sequences: 320
    tokens in 512 rows; 8: 16 tokens in 8 rows), beside the prefill's and a small step's."""
    from benchmarks.gpu.step_profile import profile_buckets

    assert profile_buckets([256, 300], 512) == ([1, 64, 256, 320, 512], [8, 256, 512])
    assert profile_buckets([1, 8], 64) == ([1, 16, 64, 512], [8, 64])
