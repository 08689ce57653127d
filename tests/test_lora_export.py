"""`python -m jdr.export` of a LoRA-trained decoder tower: the merged Hugging Face folder, and the PEFT adapter
over the un-merged base (peft-adapter/ + peft-base/), both give jdr's query vectors in transformers."""

import json
import pathlib

import numpy as np
import pytest

from conftest import run_module

ROOT = pathlib.Path(__file__).resolve().parents[1]
ROWS = 3
LENGTH = 7

pytestmark = pytest.mark.slow  # a training run in a subprocess (~30 s)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  """(the export's folder, jdr's query vectors of ROWS random id rows, the rows): a tiny Llama with LoRA
  trained 3 steps at a high rate (so the adapters are far from their zero start), then exported."""
  from conftest import write_tiny_beir  # pylint: disable=g-import-not-at-top
  from jdr import export  # pylint: disable=g-import-not-at-top
  from jdr.models import build  # pylint: disable=g-import-not-at-top
  tmp = tmp_path_factory.mktemp("lora_export")
  data = write_tiny_beir(tmp / "data")
  workdir = tmp / "work"
  overrides = ["model.init_from=", "model.fresh=llama-tiny", "model.pooling=last", "model.lora_rank=4",
               "model.lora_alpha=8.0", "model.dropout=0.0", "optimizer.learning_rate=0.05",
               "optimizer.warmup_steps=0", "batch_size=4", "log_every=1", "num_train_steps=3",
               "checkpoint_every=100", "data.query_max_length=16", "data.doc_max_length=16",
               f"data.dataset={data}", "data.eval_split="]
  proc = run_module("jdr.train", ["--config", str(ROOT / "configs" / "demo.py:tiny"), "--workdir", str(workdir)]
                    + [f"--config.{o}" for o in overrides])
  assert proc.returncode == 0, proc.stderr[-4000:]
  out = tmp / "export"
  export.main(["--workdir", str(workdir), "--out", str(out)])
  model, params, _, description = build.load_jdr_model(out)
  assert description["query"]["normalize"]
  vocab = description["query"]["encoder"]["vocab_size"]
  ids = np.random.RandomState(0).randint(1, vocab, size=(ROWS, LENGTH))
  mask = np.ones_like(ids)
  want = np.asarray(model.apply({"params": params}, ids, mask, method="encode_query"))
  return out, want, ids


def _torch_vectors(model, ids: np.ndarray) -> np.ndarray:
  """The last token's hidden state, L2-normalized: jdr's `last` pooling with `normalize` (no padding here)."""
  import torch  # pylint: disable=g-import-not-at-top
  with torch.no_grad():
    hidden = model(input_ids=torch.tensor(ids), attention_mask=torch.ones(ids.shape, dtype=torch.long))
  last = hidden.last_hidden_state[:, -1].numpy().astype(np.float64)
  return last / np.linalg.norm(last, axis=-1, keepdims=True)


def test_export_writes_the_peft_folders(exported):
  out, _, _ = exported
  config = json.loads((out / "peft-adapter" / "adapter_config.json").read_text())
  assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
  assert config["base_model_name_or_path"] == "../peft-base"
  assert (out / "peft-adapter" / "adapter_model.safetensors").is_file()
  assert (out / "peft-base" / "model.safetensors").is_file()
  base_config = json.loads((out / "peft-base" / "config.json").read_text())
  assert base_config["model_type"] == "llama" and "lora_rank" not in base_config
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  assert not any("lora" in name for name in load_file(str(out / "peft-base" / "model.safetensors")))
  assert not any("lora" in name for name in load_file(str(out / "model.safetensors")))


def test_merged_export_gives_jdr_vectors(exported):
  transformers = pytest.importorskip("transformers")
  out, want, ids = exported
  got = _torch_vectors(transformers.AutoModel.from_pretrained(str(out)).eval(), ids)
  diff = float(np.max(np.abs(got - want)))
  print(f"merged export vs jdr: max abs diff {diff:.2e}")
  assert diff < 1e-4


def test_peft_adapter_over_base_gives_jdr_vectors(exported):
  transformers = pytest.importorskip("transformers")
  peft = pytest.importorskip("peft")
  out, want, ids = exported
  base = transformers.AutoModel.from_pretrained(str(out / "peft-base")).eval()
  without = _torch_vectors(base, ids)
  model = peft.PeftModel.from_pretrained(base, str(out / "peft-adapter")).eval()
  got = _torch_vectors(model, ids)
  diff = float(np.max(np.abs(got - want)))
  print(f"PEFT adapter over peft-base vs jdr: max abs diff {diff:.2e}; base alone differs by "
        f"{np.max(np.abs(without - want)):.2e}")
  assert diff < 1e-4
  assert np.max(np.abs(without - want)) > 1e-2  # the adapters matter: the base alone is another model


def test_peft_base_model_flag(exported, tmp_path):
  """--peft-base-model puts the name asked for in adapter_config.json (a hub id the base equals)."""
  from jdr import export  # pylint: disable=g-import-not-at-top
  out, _, _ = exported
  again = tmp_path / "again"
  export.main(["--workdir", str(out), "--out", str(again), "--peft-base-model", "/models/llama-base"])
  config = json.loads((again / "peft-adapter" / "adapter_config.json").read_text())
  assert config["base_model_name_or_path"] == "/models/llama-base"
