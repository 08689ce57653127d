"""The ADORE and ANCE benchmarks run end to end at tiny sizes and print their JSON line; their parsing and
log analysis are right on hand-made inputs."""

import json
import subprocess
import sys
import textwrap

import pytest

from jdr.bench import adore_step
from jdr.bench import ance_refresh
from jdr.bench import train_step
from conftest import write_tiny_beir


def test_factories_split_on_semicolons_or_terminal_parts():
  assert adore_step.parse_factories("Flat;OPQ48,IVF1,PQ48") == ["Flat", "OPQ48,IVF1,PQ48"]
  assert adore_step.parse_factories("Flat,OPQ48,IVF1,PQ48") == ["Flat", "OPQ48,IVF1,PQ48"]
  assert adore_step.parse_factories("PQ48,Flat") == ["PQ48", "Flat"]
  with pytest.raises(ValueError, match="terminal"):
    adore_step.parse_factories("Flat,OPQ48")


@pytest.mark.parametrize("flags, isa", [
    ("fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile", ["AVX-512", "AVX512-BF16", "AMX"]),
    ("fpu avx2 avx512f avx512_bf16", ["AVX-512", "AVX512-BF16", "no AMX"]),
    ("fpu sse4_2 avx2", ["AVX2", "no AMX"]),
])
def test_cpu_info_names_the_model_and_its_matmul_instruction_sets(tmp_path, flags, isa):
  from jdr.bench import peak  # pylint: disable=g-import-not-at-top
  two = "".join(f"processor\t: {i}\nmodel name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz\nflags\t\t: {flags}\n\n"
                for i in range(2))
  (tmp_path / "cpuinfo").write_text(two)
  assert peak.cpu_info(str(tmp_path / "cpuinfo")) == {"model": "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz",
                                                       "isa": isa}


def test_cpu_suite_runs_each_benchmark_alone_and_holds_each_ratio_to_its_goal(monkeypatch, capsys, tmp_path):
  """`python -m jdr.bench cpu`: one benchmark after another, the table reads each one's JSON and says whether its
  float32 goal is met; a failed benchmark is a row saying so, not a missing row."""
  from jdr.bench import cpu_suite  # pylint: disable=g-import-not-at-top
  from jdr.bench import own_process  # pylint: disable=g-import-not-at-top
  failed = own_process.run(["no-such-benchmark"])  # a real subprocess: argparse refuses the name
  assert failed == {"error": "`python -m jdr.bench no-such-benchmark` exited 2 with no JSON line"}
  calls = []

  def fake(args):
    calls.append(args)
    if args[0] == "pretrain":
      return {"error": "`python -m jdr.bench pretrain` exited 1 with no JSON line"}
    if args[0] == "train-step":
      return {"benchmark": "train-step", "jdr": 2.1, "reference": 2.7, "ratio": 1.286, "jdr_setting": "1 device",
              "jdr_peak_fraction": 0.7, "reference_peak_fraction": 0.55}
    return {"benchmark": "encode", "dtype": "float32", "jdr": 30.9, "reference": 24.0, "ratio": 1.288,
            "jdr_peak_fraction": 0.84, "reference_peak_fraction": 0.65}

  monkeypatch.setattr(own_process, "run", fake)
  cpu_suite.main(["--only", "encode,train-step,pretrain", "--out", str(tmp_path / "cpu.json")])
  out = capsys.readouterr().out
  assert calls == [["encode"], ["train-step"], ["pretrain"]]
  assert "| encode | 30.9 docs/s | 24.0 docs/s | 1.288 | 1.3 (not met) | 84% / 65% |" in out
  assert "| train-step | 2.1 s/step (1 device) | 2.7 s/step | 1.286 | 1.2 (met) | 70% / 55% |" in out
  assert "| pretrain | `python -m jdr.bench pretrain` exited 1 with no JSON line |" in out
  assert out.startswith("host CPU: ")
  assert set(json.loads((tmp_path / "cpu.json").read_text())) == {"host_cpu", "encode", "train-step", "pretrain"}
  with pytest.raises(SystemExit):
    cpu_suite.main(["--only", "encode,nothing"])


def test_xla_flags_names_each_candidates_matmul_kernels_and_times_them_in_turns(monkeypatch, capsys):
  """`python -m jdr.bench xla-flags`: the kernels are read from the compiled HLO (a flag this jaxlib ignores compiles
  the same kernels); the candidates run forward then backward, the default always among them, each against it."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jdr.bench import xla_cpu_flags  # pylint: disable=g-import-not-at-top
  hlo = jax.jit(lambda a, b: a @ b).lower(jnp.ones((8, 16)), jnp.ones((16, 4))).compile().as_text()
  kernels = xla_cpu_flags.dot_kernels(hlo)
  assert sum(kernels.values()) == 1, (kernels, hlo)  # one matmul, named once whichever kernel runs it
  hlo = textwrap.dedent("""\
      HloModule m

      %ynn_computation (a: f32[4,8], b: f32[8,2]) -> f32[4,2] {
        ROOT %d = f32[4,2]{1,0} dot(f32[4,8]{1,0} %a, f32[8,2]{1,0} %b), lhs_contracting_dims={1}
      }

      %add_computation (x: f32[4,2]) -> f32[4,2] {
        ROOT %e = f32[4,2]{1,0} add(f32[4,2]{1,0} %x, f32[4,2]{1,0} %x)
      }

      ENTRY %main (p: f32[4,8], q: f32[8,2]) -> f32[4,2] {
        %f = f32[4,2]{1,0} fusion(%p, %q), kind=kCustom, calls=%ynn_computation, backend_config="__ynn_fusion"
        %g = f32[4,2]{1,0} fusion(%f), kind=kCustom, calls=%add_computation, backend_config="__ynn_fusion"
        %o = f32[4,2]{1,0} custom-call(%p, %q), custom_call_target="__onednn$matmul"
        ROOT %h = f32[4,2]{1,0} dot(%g, %o), lhs_contracting_dims={1}
      }
      """)
  # A YNN fusion of elementwise work is not a matmul; the entry's own dot is XLA's.
  assert xla_cpu_flags.dot_kernels(hlo) == {"ynn": 1, "onednn": 1, "xla dot": 1}
  # One candidate's own process, as the benchmark starts it, at a tiny size.
  for dtype in ("float32", "bfloat16"):
    one = xla_cpu_flags.measure("minilm", rows=1, length=16, batches=1, repeats=1, dtype=dtype)
    assert one["ms_per_batch"] > 0 and sum(one["kernels"].values()) >= 6 * 8  # six layers of eight products

  calls = []

  def fake(name, args):
    calls.append(name)
    if name == "xnnpack":
      return {"error": "exited 1: no such flag"}
    return {"kernels": {"ynn": 40}, "ms_per_batch": {"default": 100.0, "onednn": 80.0}[name] + len(calls)}

  monkeypatch.setattr(xla_cpu_flags, "run_candidate", fake)
  xla_cpu_flags.main(["--candidates", "onednn,xnnpack", "--rounds", "2"])
  captured = capsys.readouterr()
  result = json.loads(captured.out.strip().splitlines()[-1])
  assert calls == ["default", "onednn", "xnnpack", "xnnpack", "onednn", "default"]
  assert result["candidates"]["default"]["rounds_ms"] == [101.0, 106.0]
  assert result["candidates"]["onednn"]["ms_per_batch"] == 83.5  # the median of 82 and 85
  assert result["candidates"]["onednn"]["speed_vs_default"] == round(103.5 / 83.5, 3)
  assert result["candidates"]["xnnpack"] == {"error": "exited 1: no such flag"}
  assert "| xnnpack | `--xla_cpu_use_xnnpack=true` | exited 1: no such flag | | |" in captured.err
  from jdr.bench import cpu_suite  # pylint: disable=g-import-not-at-top
  assert (cpu_suite.row("xla-flags", result) ==
          f"| xla-flags | fastest: onednn, 83.5 ms a batch | default 103.5 ms a batch | {round(103.5 / 83.5, 3)} | | |")
  assert "| onednn | `--xla_cpu_use_onednn=true" in cpu_suite.table({"xla-flags": result})


def test_peak_flops_of_cls_pooling_count_the_last_layer_at_the_first_position():
  """[CLS] pooling's useful work: the whole model less the last layer's query, output and MLP products at every
  position but the first, and its attention rows but the first (a float64 count by loops, per document)."""
  from jdr.bench import peak  # pylint: disable=g-import-not-at-top
  lengths, layers, h, i = [7, 3, 12], 3, 8, 20
  full = peak.encoder_flops(lengths, layers=layers, hidden=h, intermediate=i)
  skipped = 0.0
  for n in lengths:
    for _ in range(1, n):  # positions past the first: query and output projections, the MLP pair, their attention
      skipped += 2 * (2 * h * h) + 2 * (2 * h * i) + 2 * (2 * n * h)
  first = peak.encoder_flops(lengths, layers=layers, hidden=h, intermediate=i, first_position=True)
  assert first == pytest.approx(full - skipped, rel=1e-12)


def test_ance_analysis_splits_steps_by_pending_mine_and_removes_waits():
  def line(step, time, wait, pending):
    return {"step": step, "time": time, "train/loss": 1.0, "train/negatives/wait_seconds": wait,
            "train/negatives/pending": pending, "train/negatives/mines": 2}
  # Steps 2..6 last 1 s each without a mine; steps 3 and 4 have one in flight (pending at 2 and 3), and
  # step 4 also waited 0.5 s for it, which is taken out of its duration and counted as waiting.
  records = [line(1, 10.0, 0.0, 0), line(2, 11.0, 0.0, 1), line(3, 12.5, 0.0, 1), line(4, 14.0, 0.5, 0),
             line(5, 15.0, 0.5, 0), line(6, 16.0, 0.5, 0), {"step": 6, "time": 17.0, "eval/x": 1.0}]
  r = ance_refresh.analyse(records)
  assert r["timed_steps"] == 5 and r["steps_in_flight"] == 3 and r["steps_without"] == 2
  assert r["median_step_in_flight_s"] == pytest.approx(1.0)  # durations 1.0 (step 2), 1.5, 1.0
  assert r["median_step_without_s"] == pytest.approx(1.0)
  assert r["wait_fraction"] == pytest.approx(0.5 / 6.0, abs=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["faiss", "jax"])
def test_adore_step_tiny(backend, capsys):
  adore_step.main(["--sizes", "1000", "--factories", "Flat", "--backends", backend, "--batch-size", "4",
                   "--top-n", "20", "--steps", "1", "--model", "tiny"])
  out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert [(r["size"], r["factory"], r["backend"]) for r in out["results"]] == [(1000, "Flat", backend)]
  row = out["results"][0]
  if backend == "faiss":
    assert 0 < row["retrieval_share"] < 1 and row["retrieval_s"] > 0 and row["step_s"] > 0
  else:
    assert row["step_in_step_s"] > 0 and row["step_given_s"] > 0


@pytest.mark.slow
def test_train_step_llama_lora_tiny(capsys):
  """`train-step --model llama-lora`: jdr's LoRA step and transformers + PEFT's both run and are compared."""
  train_step.main(["--model", "llama-lora", "--shape", "tiny", "--batch-size", "2", "--query-length", "8",
                   "--doc-length", "16", "--steps", "1", "--cpu-devices", "1"])
  out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert out["model"] == "llama-lora" and out["decoder"]["layers"] == 2 and out["lora"]["rank"] == 8
  assert len(out["lora"]["targets"]) == 7 and out["temperature"] == 0.01
  assert out["jdr"] > 0 and out["reference"] > 0 and out["ratio"] > 0 and out["jdr_cpu_devices"] is None


@pytest.mark.slow
def test_ance_refresh_tiny(tmp_path):
  # A subprocess, through `python -m jdr.bench`: the trainer prints to the sys.stderr it saw at import.
  data = write_tiny_beir(tmp_path / "beir")
  proc = subprocess.run([sys.executable, "-m", "jdr.bench", "ance-refresh", "--dataset", str(data), "--steps", "5",
                         "--refresh-every", "2", "--delay", "1", "--batch-size", "4", "--model", "tiny"],
                        capture_output=True, text=True, timeout=120, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  assert out["timed_steps"] == 4 and out["mines"] >= 2 and out["failed"] == 0
  assert out["steps_in_flight"] + out["steps_without"] == 4
  assert 0 <= out["wait_fraction"] < 1


@pytest.mark.long
def test_device_bench_small_on_the_cpu(scifact):
  """`python -m jdr.bench device` at its CPU size (top-k and ADORE over 20k rows, not 100k): every section runs,
  jdr and the reference agree, and --profile says where the encoder's forward and the train step spend their
  kernel time."""
  proc = subprocess.run([sys.executable, "-m", "jdr.bench", "device", "--size", "small", "--profile",
                         "--topk-sizes", "20000", "--adore-sizes", "20000"],
                        capture_output=True, text=True, timeout=900, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  assert out["platform"] == "cpu" and out["reference_device"] == "cpu" and out["size"] == "small"
  assert "--xla_backend_optimization_level=0" in out["xla_flags"]  # the suite's flag, recorded with the figures
  assert out["peak"]["peak_tflops"] > 0 and out["peak"]["bandwidth_gbps"] > 0
  encode = out["encode"]
  assert encode["docs"] == 400 and encode["min_cosine_vs_reference"] > 0.999  # the same weights, float32
  assert set(encode["reference_docs_per_s"]) == {"32", "128"} and encode["ratio"] > 0
  assert 0 <= encode["jdr_padding_fraction"] < 0.5  # length buckets keep padding small
  assert out["train"]["jdr_ms"] > 0 and out["train"]["reference_ms"] > 0
  for kernels in (encode["forward_only"]["kernels"], out["train"]["jdr_kernels"],
                  out["train"]["jdr_attention_dropout_0_kernels"]):
    assert kernels["kernel_ms"] > 0 and "matmul" in kernels["by_category"], kernels
  assert out["train"]["jdr_kernels"]["module"] == "jit_train_step"
  [row] = out["topk"]["rows"]
  assert row["size"] == 20_000 and row["agreement"] == 1.0 and row["bound_ms"] > 0
  assert row["same_rows_as_single_top_k"] is True and row["single_top_k_ms"] > 0
  assert row["int8_recall_vs_exact"] > 0.9
  [adore] = out["adore"]["rows"]
  assert adore["size"] == 20_000 and adore["step_in_step_s"] > 0


def test_a_benchmark_help_is_its_own():
  """`python -m jdr.bench NAME --help` lists NAME's options, not the dispatcher's."""
  proc = subprocess.run([sys.executable, "-m", "jdr.bench", "device", "--help"], capture_output=True, text=True,
                        timeout=120, check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.startswith("usage: python -m jdr.bench device") and "--profile" in proc.stdout


@pytest.mark.slow
def test_compiled_kernels_of_the_host_and_a_config_override(capsys):
  """`python -m jdr.bench compiled --target host`: the forward and the train step compiled here (a GPU target
  needs jax's CUDA plugin), each with its kernels by kind; a --config override reaches the compiled step."""
  from jdr.bench import compiled_kernels  # pylint: disable=g-import-not-at-top
  small = ["--target", "host", "--fresh", "tiny", "--rows", "4", "--length", "16", "--train-batch", "2",
           "--query-length", "8", "--doc-length", "16"]
  compiled_kernels.main(small)
  out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert out["target"] == "host" and out["bandwidth"] is None and set(out["programs"]) == {"forward", "train"}
  for summary in out["programs"].values():
    assert summary["kernels"] == sum(v["kernels"] for v in summary["by_category"].values()) > 0
    assert "matmul" in summary["by_category"] and summary["gigabytes"] > 0
  # Attention dropout drawn on the einsum path is work of its own in the step: without it, fewer kernels.
  compiled_kernels.main([*small, "--programs", "train", "--config.model.attention_dropout=0"])
  no_dropout = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert no_dropout["overrides"] == ["model.attention_dropout=0"]
  assert no_dropout["programs"]["train"]["kernels"] < out["programs"]["train"]["kernels"]
  # ADORE's step with its top-n retrieved inside moves the corpus matrix besides what the given step moves.
  compiled_kernels.main([*small, "--programs", "adore,adore-given", "--corpus-rows", "20000", "--adore-batch", "2",
                         "--top-n", "8"])
  adore = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["programs"]
  matrix_gb = 20000 * 64 * 4 / 1e9  # float32 on the CPU, the tiny model's 64 dimensions
  assert adore["adore"]["gigabytes"] - adore["adore-given"]["gigabytes"] >= matrix_gb - 1e-3
  with pytest.raises(SystemExit):
    compiled_kernels.main([*small, "--programs", "backward"])
  import importlib.util  # pylint: disable=g-import-not-at-top
  if importlib.util.find_spec("jax_plugins") is None:  # no CUDA plugin: a GPU target is a usage error
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
      compiled_kernels.main(["--target", "h200"])
    assert exit_info.value.code == 2 and "needs jax's CUDA plugin" in capsys.readouterr().err


def test_eval_candidates_bench_small(tmp_path, capsys):
  """`python -m jdr.bench eval-candidates` on a synthetic corpus with a fresh tiny model: both kinds run and the
  JSON line compares them."""
  from jdr.bench import eval_candidates  # pylint: disable=g-import-not-at-top
  eval_candidates.main(["--passages", "300", "--model", "", "--doc-max-length", "32", "--depth", "20",
                        "--root", str(tmp_path)])
  result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert result["documents"] == 300 and result["depth"] == 20 and result["queries"] >= 5
  assert result["candidates"].keys() == result["full"].keys() == {"ndcg@10", "mrr@10", "recall@100"}
  assert 0 < result["candidate_documents"] <= result["queries"] * 20
  assert result["jdr"] > 0 and result["reference"] > 0


@pytest.mark.slow
def test_encode_bench_in_bfloat16_compares_each_side_with_its_own_float32(capsys):
  """`encode --dtype bfloat16`: jdr in bfloat16 against sentence-transformers under torch.autocast, each side's
  vectors then compared with its own float32 ones, and the bfloat16 matmul peak measured."""
  from jdr.bench import encode_speed  # pylint: disable=g-import-not-at-top
  from jdr.data import shared  # pylint: disable=g-import-not-at-top
  if shared.shared_dataset("scifact") is None:
    pytest.skip(f"needs SciFact in {shared.shared_data_dir()}")
  encode_speed.main(["--num-docs", "6", "--dtype", "bfloat16", "--reference-batch-size", "3"])
  out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert out["dtype"] == "bfloat16" and out["jdr"] > 0 and out["reference"] > 0
  for side in ("jdr", "reference"):
    cosine = out[f"{side}_cosine_to_float32"]
    assert 0.999 < cosine["min"] <= cosine["mean"] < 1.0  # rounded, yet the same vectors
  assert out["bfloat16_peak_gflops"] > 0 and out["max_abs_diff_vs_reference"] < 0.01
  # Two rounds in turns; each side's rate is over its mean time.
  assert len(out["jdr_seconds"]) == len(out["reference_seconds"]) == out["rounds"] == 2
  assert out["jdr"] == pytest.approx(12 / sum(out["jdr_seconds"]), rel=0.02)
