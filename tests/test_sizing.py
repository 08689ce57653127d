"""`python -m jdr.train --compile-only` on 8 simulated CPU devices: per-device figures from the shardings and
XLA, without data or training."""

import json
import pathlib
import subprocess
import sys

import pytest

from conftest import cpu_devices_env
from jdr.training import sizing

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ["--config.model.init_from=", "--config.model.fresh=tiny", "--config.batch_size=16",
        "--config.data.query_max_length=16", "--config.data.doc_max_length=32"]


def _sizes(*extra, config="demo.py"):
  env = cpu_devices_env(8, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  out = subprocess.run([sys.executable, "-m", "jdr.train", "--config", str(ROOT / "configs" / config),
                        "--compile-only", *TINY, *extra], env=env, capture_output=True, text=True, timeout=600,
                       check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_compile_only_reports_per_device_memory_and_flops(tmp_path):
  dp = _sizes("--config.mesh.shape=(8,1,1)", "--config.mesh.rules=dp")
  fsdp = _sizes("--config.mesh.shape=(2,4,1)", "--config.mesh.rules=fsdp")
  assert dp["devices"] == fsdp["devices"] == 8 and dp["parameters"] == fsdp["parameters"]
  # Data parallel replicates the parameters (4 bytes each); fully sharded splits them about 4 ways.
  assert dp["params_bytes_per_device"] == 4 * dp["parameters"]
  assert 3.5 < dp["params_bytes_per_device"] / fsdp["params_bytes_per_device"] <= 4.0
  assert dp["optimizer_bytes_per_device"] >= 2 * dp["params_bytes_per_device"]  # Adam's two moments
  for sizes in (dp, fsdp):
    assert sizes["temp_bytes"] > 0 and sizes["flops_per_device"] > 0
    assert sizes["total_bytes_per_device"] >= sizes["params_bytes_per_device"]
  # Each device does its share of the towers either way, but a data-parallel device also repeats the whole
  # optimizer update that fully sharded devices split.
  assert dp["flops_per_device"] > fsdp["flops_per_device"]
  assert not (tmp_path / "w").exists()  # nothing written: no workdir was given


@pytest.mark.slow
def test_adore_and_ltre_compile_against_an_abstract_ms_marco_corpus():
  """ADORE's full recipe (Faiss on the host) and LTRe's with the JAX search in the step compile with
  --compile-only against MS MARCO's 8,841,823 rows without creating them; the bytes are checked against the
  shapes the step takes (jdr/data/batch.py's corpus form, jdr.retrieval.topk's padded row shards)."""
  n, d, b, lq, top, devices = sizing.MSMARCO_PASSAGES, 32, 16, 16, 200, 8
  tiny = ["--config.model.projection_dim=32", "--config.mesh.shape=(8,1,1)"]
  host = _sizes(*tiny, config="adore.py")
  assert host["retrieval"] == "host" and host["corpus_rows"] == n and host["corpus_dim"] == d
  assert host["corpus_bytes_per_device"] == 0 and host["corpus_host_bytes"] == n * d * 4  # float32, memory-mapped
  # A device's rows of the batch: query ids and mask, the positive's row, the 200 candidates' rows and vectors
  # and the positive's vector (float32), all split over the 8 devices.
  per_row = 2 * lq * 4 + 4 + top * 4 + top * d * 4 + d * 4
  assert host["batch_bytes_per_device"] == b // devices * per_row
  in_step = _sizes(*tiny, config="ltre.py:jax")
  assert in_step["retrieval"] == "in_step" and in_step["corpus_dtype"] == "float32"  # the recipe's, as DRhard's
  rows = -(-n // (devices * 128)) * 128  # each device's shard, padded to whole 128-row blocks
  assert in_step["corpus_bytes_per_device"] == rows * d * 4 + rows * 4  # the rows and their -inf/0 bias
  assert in_step["batch_bytes_per_device"] == b // devices * (2 * lq * 4 + 4)
  # The shard is an argument of the step, so its total holds it; the host keeps nothing.
  assert in_step["argument_bytes"] >= in_step["corpus_bytes_per_device"] and in_step["corpus_host_bytes"] == 0
  assert in_step["total_bytes_per_device"] > in_step["corpus_bytes_per_device"] > host["total_bytes_per_device"]
  assert in_step["params_bytes_per_device"] == host["params_bytes_per_device"]


def test_gpu_targets_name_the_gpus_of_one_host():
  assert sizing.gpu_target("h100") == ("h100", 1) and sizing.gpu_target("h200:8") == ("h200", 8)
  assert sizing.gpu_target("v5e:2x4") is None
  with pytest.raises(ValueError, match="the GPUs of one host come after the colon, e.g. h100:8"):
    sizing.gpu_target("h100:two")


def test_tpu_slices_compile_ahead_of_time_with_tpu_defaults():
  """--topology: the devices come from libtpu's description of the slice (no TPU needed, but libtpu is: its
  absence is a clear error), and the model is traced with the TPU's defaults (bfloat16, fused attention)."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  from jdr.runtime import parallel  # pylint: disable=g-import-not-at-top
  from jdr.models import build  # pylint: disable=g-import-not-at-top
  assert build.compute_dtype("auto") == "float32" and parallel.platform() == "cpu"
  with parallel.compiling_for("tpu"):
    assert build.compute_dtype("auto") == "bfloat16" and parallel.platform() == "tpu"
  assert parallel.platform() == "cpu"
  if importlib.util.find_spec("libtpu") is not None:
    assert len(sizing.topology_devices("v5e:2x2")) == 4
  else:
    with pytest.raises(ValueError, match=r"--topology v5e:2x2: no TPU topology description .*pip install 'jax\[tpu\]'"):
      sizing.topology_devices("v5e:2x2")


def test_gpu_targets_compile_from_a_cpu_host_or_say_what_it_takes():
  """A GPU of sizing.GPU_TARGETS as a device to compile for: with jax's CUDA plugin (no GPU needed) one
  device of that kind; without it a clear error that names the plugin."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  config = sizing.gpu_target_config("h200")
  assert "core_count: 132" in config and "memory_bandwidth: 4800000000000" in config
  assert 'device_description_str: "NVIDIA H200 141GB HBM3e"' in config
  with pytest.raises(ValueError, match="unknown GPU target 'a100'; known: h100, h200"):
    sizing.gpu_target_devices("a100")
  plugin = importlib.util.find_spec("jax_plugins") is not None and any(
      importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") for v in (12, 13))
  if plugin:
    (device,) = sizing.gpu_target_devices("h200")
    assert device.platform in ("gpu", "cuda")
    from jdr.runtime import defaults  # pylint: disable=g-import-not-at-top
    config = defaults.get_config()
    config.model.init_from, config.model.fresh, config.batch_size = "", "tiny", 4
    sizes = sizing.size_step(config, topology="h200")
    assert sizes["device_kind"] == "NVIDIA H200 141GB HBM3e" and sizes["devices"] == 1
    assert sizes["temp_bytes"] > 0 and sizes["flops_per_device"] is None  # no cost analysis without the GPU
  else:
    with pytest.raises(ValueError, match=r"GPU target h200: .*jax's CUDA plugin \(pip install 'jax\[cuda12\]'"):
      sizing.gpu_target_devices("h200")


def test_the_train_step_compiles_without_the_dot_merger_on_gpus_only():
  """Every jitted train step takes jdr.training.step.compiler_options for the platform it is compiled for: on GPUs the
  dot merger is off (it concatenated the shared towers' query and document activations), elsewhere nothing."""
  from jdr.runtime import parallel  # pylint: disable=g-import-not-at-top
  from jdr.training import step as step_lib  # pylint: disable=g-import-not-at-top
  assert step_lib.compiler_options() == {}
  with parallel.compiling_for("gpu"):
    assert step_lib.compiler_options() == {"xla_gpu_dot_merger_threshold_mb": 0}
  with parallel.compiling_for("tpu"):
    assert step_lib.compiler_options() == {}


def test_the_report_says_when_the_compiler_gave_no_flops(capsys):
  sizes = {"mesh": {"data": 1}, "rules": "dp", "batch_size": 4, "parameters": 10, "params_bytes_per_device": 40,
           "optimizer_bytes_per_device": 80, "temp_bytes": 2**20, "total_bytes_per_device": 2**21,
           "flops_per_device": None, "topology": "h200", "device_kind": "NVIDIA H200 141GB HBM3e"}
  sizing.report(sizes)
  first = capsys.readouterr().out.splitlines()[0]
  assert "of h200 (NVIDIA H200 141GB HBM3e)" in first and first.endswith("FLOPs not reported by this compiler")
