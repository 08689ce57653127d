"""The kernel breakdown of `jdr.bench.kernel_profile`: own times of nested events, the kinds of work read
from GPU-style HLO text, and a real trace of a jitted call on the CPU."""

import jax
import jax.numpy as jnp
import pytest

from jdr.bench import kernel_profile as kp

# Optimized HLO as XLA's GPU backend prints it (shapes, layouts, custom-call targets and fusion kinds as
# its compiled text has them; operands with and without their shapes).
GPU_HLO = """HloModule jit_train_step, is_scheduled=true, entry_computation_layout={(bf16[4,256,768]{2,1,0})->f32[]}

%fused_transpose (param_0: bf16[4,12,256,64]) -> bf16[4,256,12,64] {
  %param_0 = bf16[4,12,256,64]{3,2,1,0} parameter(0)
  ROOT %transpose.3 = bf16[4,256,12,64]{3,2,1,0} transpose(%param_0), dimensions={0,2,1,3}
}

%fused_gelu (param_0.1: bf16[1024,3072]) -> bf16[1024,3072] {
  %param_0.1 = bf16[1024,3072]{1,0} parameter(0)
  %convert.1 = f32[1024,3072]{1,0} convert(%param_0.1)
  %erf.1 = f32[1024,3072]{1,0} erf(%convert.1)
  ROOT %convert.2 = bf16[1024,3072]{1,0} convert(%erf.1), metadata={op_name="jit(train_step)/jvp(Tower)/encoder/layer_0/erf"}
}

%triton_gemm_computation (p0: bf16[1024,768], p1: bf16[768,768]) -> bf16[1024,768] {
  %p0 = bf16[1024,768]{1,0} parameter(0)
  %p1 = bf16[768,768]{1,0} parameter(1)
  ROOT %dot.5 = bf16[1024,768]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main.9 (x.1: bf16[4,256,768]) -> f32[] {
  %x.1 = bf16[4,256,768]{2,1,0} parameter(0)
  %w = bf16[768,3072]{1,0} parameter(1)
  %bitcast.1 = bf16[1024,768]{1,0} bitcast(%x.1)
  %custom-call.12 = (bf16[1024,3072]{1,0}, s8[4194304]{0}) custom-call(bf16[1024,768]{1,0} %bitcast.1, bf16[768,3072]{1,0} %w), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{}}
  %fmha-bmm-softmax-bmm = (bf16[4,12,256,64]{3,1,2,0}, u8[0]{0}) custom-call(q, k, v), custom_call_target="__cudnn$fmhaSoftmax", operand_layout_constraints={bf16[4,256,12,64]{3,2,1,0}}
  %custom-call.13 = bf16[4,256,12,64]{3,2,1,0} custom-call(q, k, v), custom_call_target="__gpu$xla.gpu.triton", backend_config={"name":"flash_forward"}
  %get-tuple-element.2 = bf16[1024,3072]{1,0} get-tuple-element(%custom-call.12), index=0
  %loop_transpose_fusion = bf16[4,256,12,64]{3,2,1,0} fusion(%get-tuple-element.1), kind=kLoop, calls=%fused_transpose
  %loop_convert_fusion.2 = bf16[1024,3072]{1,0} fusion(%get-tuple-element.2), kind=kLoop, calls=%fused_gelu
  %gemm_fusion = bf16[1024,768]{1,0} fusion(a, b), kind=kCustom, calls=%triton_gemm_computation, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %all-reduce-start = f32[768]{0} all-reduce-start(%g), replica_groups={{0,1}}, to_apply=%add
  ROOT %copy.4 = f32[] copy(%r)
}
"""


KERNELS = ("custom-call.12", "fmha-bmm-softmax-bmm", "custom-call.13", "loop_transpose_fusion",
           "loop_convert_fusion.2", "gemm_fusion", "all-reduce-start", "copy.4")


def test_gpu_hlo_instructions_fall_into_their_kinds_of_work():
  module, computations = kp.parse_hlo(GPU_HLO)
  assert module == "jit_train_step"
  entry = {i.name: i for i in computations["main.9"]}
  kinds = {name: kp.categorize(i, computations) for name, i in entry.items() if name in KERNELS}
  assert kinds == {"custom-call.12": "matmul",
                   "fmha-bmm-softmax-bmm": "fused attention", "custom-call.13": "pallas kernel",
                   "loop_transpose_fusion": "transpose / copy",
                   "loop_convert_fusion.2": "other fusion (elementwise, reductions)", "gemm_fusion": "matmul",
                   "all-reduce-start": "collective", "copy.4": "transpose / copy"}
  assert set(kinds.values()) <= set(kp.CATEGORIES)
  assert entry["custom-call.12"].shape == "(bf16[1024,3072], s8[4194304])"
  # Least traffic: operands (printed with or without their shapes) read once, the result written once.
  assert entry["custom-call.12"].operands == ("bitcast.1", "w")
  assert kp.shape_bytes("(bf16[1024,3072], s8[4194304], pred[3], f32[])") == 1024 * 3072 * 2 + 4194304 + 3 + 4
  gemm_bytes = (1024 * 3072 * 2 + 4194304) + 1024 * 768 * 2 + 768 * 3072 * 2  # result (+ workspace), operands
  assert kp.traffic_bytes(entry["custom-call.12"], entry) == gemm_bytes
  assert kp.traffic_bytes(entry["loop_convert_fusion.2"], entry) == 2 * 1024 * 3072 * 2
  assert all(i.in_entry for i in entry.values())
  assert not any(i.in_entry for i in computations["triton_gemm_computation"])
  # A fusion is described by its root and the jax operation that root came from.
  assert kp.describe(entry["loop_convert_fusion.2"], computations) == \
      "convert bf16[1024,3072] jvp(Tower)/encoder/layer_0/erf"


def test_own_time_leaves_out_nested_events_on_the_same_line():
  event = lambda op, start, duration, line="t": kp.KernelEvent("m", op, start, duration, line)
  events = [event("while", 0, 100), event("body_a", 10, 30), event("inner", 15, 5), event("body_b", 50, 10),
            event("next", 200, 10), event("other_thread", 20, 50, line="u")]
  own = {e.op: t for e, t in kp.self_times(events)}
  assert own == {"while": 60, "body_a": 25, "inner": 5, "body_b": 10, "next": 10, "other_thread": 50}


def test_summary_counts_the_module_own_kernels_per_call():
  events = [kp.KernelEvent("jit_train_step", "custom-call.12", 0, 4e6, "s"),
            kp.KernelEvent("jit_train_step", "custom-call.12", 10e6, 4e6, "s"),
            kp.KernelEvent("jit_train_step", "loop_convert_fusion.2", 5e6, 2e6, "s"),
            kp.KernelEvent("", "loop_transpose_fusion", 20e6, 2e6, "s"),   # no module stat, op of this one
            kp.KernelEvent("jit_other", "custom-call.12", 30e6, 50e6, "s")]  # another module: not counted
  # An instruction outside the entry computation runs as often as its events say (a loop body's, say).
  events += [kp.KernelEvent("jit_train_step", "dot.5", 100e6 + i * 1e6, 0.5e6, "s") for i in range(4)]
  summary = kp.summarize(events, GPU_HLO, calls=2)
  assert summary["kernel_ms"] == 7.0  # (4 + 4 + 2 + 2 + 4 x 0.5) ms over 2 calls
  assert summary["by_category"] == {"matmul": {"ms": 5.0, "share": 0.714},
                                    "other fusion (elementwise, reductions)": {"ms": 1.0, "share": 0.143},
                                    "transpose / copy": {"ms": 1.0, "share": 0.143}}
  assert summary["top"][0]["op"] == "custom-call.12" and summary["top"][0]["events"] == 1
  convert = next(r for r in summary["top"] if r["op"] == "loop_convert_fusion.2")
  assert convert["gbps"] == round(2 * 1024 * 3072 * 2 / 1e6, 1)  # 12.6 MB a call in 1 ms
  gemm = next(r for r in summary["top"] if r["op"] == "custom-call.12")
  assert gemm["bytes_a_call"] == (1024 * 3072 * 2 + 4194304) + 1024 * 768 * 2 + 768 * 3072 * 2  # 2 kernels, 1 run
  dot = next(r for r in summary["top"] if r["op"] == "dot.5")
  assert dot["events"] == 2 and dot["bytes_a_call"] == 2 * (2 * 1024 * 768 * 2 + 768 * 768 * 2)
  assert "error" in kp.summarize(events[4:5], GPU_HLO, calls=1)  # only the other module's


@pytest.mark.filterwarnings("ignore")
def test_a_traced_jitted_call_on_the_cpu_reports_its_own_instructions():
  f = jax.jit(lambda a, b: jnp.tanh(a @ b).T + 1.0)
  g = jax.jit(lambda a: jnp.sort(a, axis=0))  # runs in the same calls, belongs to another module
  a = jnp.ones((256, 256))
  text = f.lower(a, a).compile().as_text()
  module, computations = kp.parse_hlo(text)
  names = {i.name for body in computations.values() for i in body}

  def run():
    jax.block_until_ready(g(a))
    jax.block_until_ready(f(a, a))

  summary = kp.profile_calls(run, text, calls=2)
  assert summary["module"] == module and summary["calls"] == 2
  assert summary["kernel_ms"] > 0
  assert {r["op"] for r in summary["top"]} <= names
  assert "matmul" in summary["by_category"]
  assert sum(c["ms"] for c in summary["by_category"].values()) == pytest.approx(summary["kernel_ms"], abs=0.01)
  assert kp.table(summary, "f").startswith(f"f: {summary['kernel_ms']} ms")


def test_a_failing_profile_leaves_the_device_bench_section_its_timings(monkeypatch):
  from jdr.bench import device  # pylint: disable=g-import-not-at-top

  def no_profiler(*args, **kwargs):
    raise RuntimeError("no CUPTI")

  monkeypatch.setattr(kp, "profile_calls", no_profiler)
  f = jax.jit(lambda x: x + 1)
  x = jnp.ones(3)
  run = lambda: jax.block_until_ready(f(x))  # pylint: disable=unnecessary-lambda-assignment
  assert device.kernels_if_profiling({"profile": True}, "f", f, (x,), run) == {"error": "RuntimeError: no CUPTI"}
  assert device.kernels_if_profiling({"profile": False}, "f", f, (x,), run) is None


def test_compiled_summary_counts_each_kernel_once_with_its_least_traffic():
  summary = kp.compiled_summary(GPU_HLO, bandwidth=1e12, top=20)
  # The eight kernels of the entry; parameters, the bitcast and the get-tuple-element launch nothing.
  assert summary["kernels"] == len(KERNELS)
  assert summary["loops"] == 0
  categories = summary["by_category"]
  assert sum(v["kernels"] for v in categories.values()) == len(KERNELS)
  assert categories["matmul"]["kernels"] == 2 and categories["transpose / copy"]["kernels"] == 2
  # The GELU fusion reads and writes a bf16 [1024, 3072]: 2 x 6,291,456 bytes, 12.58 us at 1 TB/s.
  gelu = next(r for r in summary["top"] if r["what"].startswith("convert bf#[#,#]"))
  assert gelu["gigabytes"] == round(2 * 1024 * 3072 * 2 / 1e9, 3)
  assert gelu["ms_at_bandwidth"] == round(1e3 * 2 * 1024 * 3072 * 2 / 1e12, 3)
  # At 1 TB/s a gigabyte takes a millisecond.
  assert summary["ms_at_bandwidth"] == pytest.approx(summary["gigabytes"], abs=1e-3)
  table = kp.compiled_table(summary, "test")
  assert table.startswith(f"test: {len(KERNELS)} kernels")


def test_compiled_summary_groups_the_same_work_of_every_layer():
  layer = """
%fused_add.{i} (p.{i}: bf16[8,16]) -> bf16[8,16] {{
  %p.{i} = bf16[8,16]{{1,0}} parameter(0)
  ROOT %add.{i} = bf16[8,16]{{1,0}} add(%p.{i}, %p.{i}), metadata={{op_name="jit(f)/encoder/layer_{i}/add"}}
}}
"""
  text = "HloModule jit_f\n" + "".join(layer.format(i=i) for i in range(3)) + """
ENTRY %main (x: bf16[8,16]) -> bf16[8,16] {
  %x = bf16[8,16]{1,0} parameter(0)
  %loop_add_fusion.0 = bf16[8,16]{1,0} fusion(%x), kind=kLoop, calls=%fused_add.0
  %loop_add_fusion.1 = bf16[8,16]{1,0} fusion(%loop_add_fusion.0), kind=kLoop, calls=%fused_add.1
  ROOT %loop_add_fusion.2 = bf16[8,16]{1,0} fusion(%loop_add_fusion.1), kind=kLoop, calls=%fused_add.2
}
"""
  summary = kp.compiled_summary(text)
  assert summary["kernels"] == 3 and summary["ms_at_bandwidth"] is None
  (group,) = summary["top"]
  assert group["kernels"] == 3 and group["what"] == "add bf#[#,#] encoder/layer_#/add"


def test_a_fusion_that_gathers_rows_of_a_matrix_reads_those_rows_only():
  """An in-step retrieval scores the candidate rows it gathers from the whole corpus inside one fusion: the
  least traffic counts the gathered rows, not the matrix (and the indices in full)."""
  text = """HloModule jit_step

%fused_score (p0: bf16[100000,64], p1: s32[4,8,1], p2: f32[4,64]) -> f32[4,8] {
  %p0 = bf16[100000,64]{1,0} parameter(0)
  %p1 = s32[4,8,1]{2,1,0} parameter(1)
  %gather.1 = bf16[4,8,64]{2,1,0} gather(%p0, %p1), offset_dims={2}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=2, slice_sizes={1,64}
  %convert.1 = f32[4,8,64]{2,1,0} convert(%gather.1)
  %p2 = f32[4,64]{1,0} parameter(2)
  %broadcast.1 = f32[4,8,64]{2,1,0} broadcast(%p2), dimensions={0,2}
  %multiply.1 = f32[4,8,64]{2,1,0} multiply(%convert.1, %broadcast.1)
  %c = f32[] constant(0)
  ROOT %reduce.1 = f32[4,8]{1,0} reduce(%multiply.1, %c), dimensions={2}, to_apply=%add
}

ENTRY %main (corpus: bf16[100000,64], rows: s32[4,8,1], q: f32[4,64]) -> f32[4,8] {
  %corpus = bf16[100000,64]{1,0} parameter(0)
  %rows = s32[4,8,1]{2,1,0} parameter(1)
  %q = f32[4,64]{1,0} parameter(2)
  ROOT %input_reduce_fusion = f32[4,8]{1,0} fusion(%corpus, %rows, %q), kind=kInput, calls=%fused_score
}
"""
  _, computations = kp.parse_hlo(text)
  instructions = {i.name: i for body in computations.values() for i in body}
  fusion = instructions["input_reduce_fusion"]
  gathered, indices, queries, result = 4 * 8 * 64 * 2, 4 * 8 * 4, 4 * 64 * 4, 4 * 8 * 4
  assert kp.traffic_bytes(fusion, instructions, computations) == gathered + indices + queries + result
  # Without the fused computation to look into, every operand counts whole (the corpus included).
  assert kp.traffic_bytes(fusion, instructions) == 100000 * 64 * 2 + indices + queries + result
  assert kp.compiled_summary(text)["gigabytes"] == round((gathered + indices + queries + result) / 1e9, 3)


PTX = """//
// Generated by LLVM NVPTX Back-End
.version 8.4
.target sm_90a
.address_size 64
.visible .entry _dkdv_kernel__1(
{
	wgmma.fence.sync.aligned;
	wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%f1}, %rd1, %rd2, 1, 1, 1, 0, 1;
	wgmma.commit_group.sync.aligned;
}
"""
PTXAS = """ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized due to non wgmma instructions defining accumulator registers of a wgmma between start and end of the pipeline stage in the function '_dkdv_kernel__1'
ptxas info    : Compiling entry function '_dkdv_kernel__1' for 'sm_90a'
    0 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 241 registers, used 1 barriers
"""


def test_triton_kernels_are_read_from_their_ptx_and_ptxas_report(tmp_path):
  from jdr.bench import compiled_kernels as ck  # pylint: disable=g-import-not-at-top
  hlo = ('%a = bf16[2,64]{1,0} custom-call(%x), custom_call_target="__gpu$xla.gpu.triton", '
         'backend_config={debug = false, grid_x = 2 : i32, name = "_dkdv_kernel", num_stages = 2 : i32}\n'
         '%b = f32[2]{0} custom-call(%y), custom_call_target="__cublas$gemm", backend_config={name = "no"}')
  assert ck.triton_kernel_names(hlo) == {"_dkdv_kernel"}
  got = ck.ptx_kernel(PTX, PTXAS)
  assert got == {"name": "_dkdv_kernel__1", "target": "sm_90a", "tensor_cores": "wgmma", "registers": 241,
                 "spill_bytes": 8, "stack_bytes": 0, "warnings": [got["warnings"][0]]}
  assert got["warnings"][0].startswith("wgmma.mma_async instructions are serialized")
  old = ck.ptx_kernel(PTX.replace("wgmma.mma_async", "mma.sync.aligned.m16n8k16").replace("wgmma.", "x."))
  assert old["tensor_cores"] == "mma.sync" and old["registers"] is None and old["warnings"] == []
  assert ck.ptx_kernel(PTX.replace("wgmma", "fma"))["tensor_cores"] == "none"
  # From a dump folder: only the named Triton kernels (a variant's __N suffix included), not XLA's fusions.
  (tmp_path / "module.1.ptx").write_text(PTX)
  (tmp_path / "module.2.ptx").write_text(PTX.replace("_dkdv_kernel__1", "loop_add_fusion"))
  report = ck.triton_kernel_report(str(tmp_path), {"_dkdv_kernel"})
  assert [k["name"] for k in report] == ["_dkdv_kernel__1"]
  assert "_dkdv_kernel__1" in ck.triton_table(report)
