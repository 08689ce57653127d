"""Each published family trains a step in jdr and exports back to its own format: the export loads in
sentence-transformers (and ANCE's head layout in a transcription of its reference code) with jdr's vectors."""

import json
import pathlib
import shutil

import jax
import numpy as np
import pytest

from conftest import write_tiny_beir
from jdr.models import hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]
TEXTS = ["what causes scurvy?", "a lack of vitamin C in the diet causes scurvy", "hi"]


@pytest.fixture(scope="module")
def tokenizer_dir():
  try:
    return hf.minilm_path()
  except FileNotFoundError as e:
    pytest.skip(f"bundled MiniLM checkpoint unavailable: {e}")


def _with_tokenizer(path: pathlib.Path, tokenizer_dir) -> pathlib.Path:
  for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
    if (tokenizer_dir / name).exists():
      shutil.copy(tokenizer_dir / name, path / name)
  return path


def _tiny(model):
  torch.manual_seed(1)
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.05 * torch.randn_like(p))
  return model.eval()


BERT_SHAPE = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=37, max_position_embeddings=128)


def distilbert_dir(root, tokenizer_dir):
  model = _tiny(transformers.DistilBertModel(transformers.DistilBertConfig(
      vocab_size=30522, dim=32, n_layers=2, n_heads=4, hidden_dim=37, max_position_embeddings=128)))
  model.save_pretrained(root / "distilbert")
  return _with_tokenizer(root / "distilbert", tokenizer_dir)


def ance_dir(root, tokenizer_dir):
  roberta = _tiny(transformers.RobertaModel(transformers.RobertaConfig(**BERT_SHAPE, pad_token_id=0),
                                            add_pooling_layer=False))
  state = {f"roberta.{k}": v for k, v in roberta.state_dict().items()}
  state.update({"embeddingHead.weight": 0.2 * torch.randn(24, 32), "embeddingHead.bias": 0.1 * torch.randn(24),
                "norm.weight": 1 + 0.1 * torch.randn(24), "norm.bias": 0.1 * torch.randn(24)})
  path = root / "ance"
  path.mkdir()
  config = {**roberta.config.to_dict(), "architectures": ["RobertaDot_NLL_LN"]}
  (path / "config.json").write_text(json.dumps(config))
  torch.save(state, path / "pytorch_model.bin")
  return _with_tokenizer(path, tokenizer_dir)


def dpr_dirs(root, tokenizer_dir):
  config = transformers.DPRConfig(**BERT_SHAPE, projection_dim=16)
  for name, cls in (("q", transformers.DPRQuestionEncoder), ("ctx", transformers.DPRContextEncoder)):
    _tiny(cls(config)).save_pretrained(root / f"dpr-{name}")
    _with_tokenizer(root / f"dpr-{name}", tokenizer_dir)
  return root / "dpr-q", root / "dpr-ctx"


def st_dir(root, tokenizer_dir):
  """MiniLM with a Dense(tanh) layer after its pooling, Normalize, and E5-style prompts."""
  st = pytest.importorskip("sentence_transformers")
  try:
    from sentence_transformers.sentence_transformer import modules
  except ImportError:
    from sentence_transformers import models as modules
  base = modules.Transformer(str(tokenizer_dir), max_seq_length=32)
  model = st.SentenceTransformer(modules=[
      base, modules.Pooling(384, pooling_mode="mean"), modules.Dense(384, 48, activation_function=torch.nn.Tanh()),
      modules.Normalize()], device="cpu", prompts={"query": "query: ", "document": "passage: "})
  model.save(str(root / "st"))
  return root / "st"


def _train(tmp_path, init_from, *extra):
  from jdr.runtime import config_files
  from jdr.training import trainer
  data = write_tiny_beir(tmp_path / "data")
  config = config_files.load_config_file(str(ROOT / "configs" / "demo.py"))
  config_files.apply_overrides(config, [
      f"model.init_from={init_from}", "model.dropout=0.0", "batch_size=4", "optimizer.learning_rate=1e-3",
      "optimizer.warmup_steps=1", "data.query_max_length=16", "data.doc_max_length=32", f"data.dataset={data}",
      "data.eval_split=", "num_train_steps=2", "checkpoint_every=0", *extra])
  out = trainer.train_and_evaluate(config, tmp_path / "w")
  from jdr import export
  export.export(tmp_path / "w", tmp_path / "export")
  return jax.device_get(out["state"].params), tmp_path / "export"


def _jdr_vectors(model, side, texts=TEXTS):
  from jdr.retrieval import encoder_runtime
  runtime = encoder_runtime.load_runtime(str(model), side=side, dtype="float32")
  return encoder_runtime.encode_texts(runtime, texts), runtime


def _st_vectors(folder, texts=TEXTS, **kw):
  st = pytest.importorskip("sentence_transformers")
  return st.SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_numpy=True, **kw)


def test_distilbert_trains_and_exports(tmp_path, tokenizer_dir):
  params, export = _train(tmp_path, distilbert_dir(tmp_path, tokenizer_dir))
  ours, _ = _jdr_vectors(export, "doc")
  config = json.loads((export / "config.json").read_text())
  assert config["model_type"] == "distilbert"
  diff = float(np.abs(_st_vectors(export) - ours).max())
  print(f"distilbert export: sentence-transformers vs jdr max abs diff {diff:.2e}")
  assert diff < 1e-5


def test_ance_trains_and_exports_in_its_own_layout(tmp_path, tokenizer_dir):
  params, export = _train(tmp_path, ance_dir(tmp_path, tokenizer_dir))
  assert "projection_norm" in params["tower"]
  ours, _ = _jdr_vectors(export, "doc")
  from safetensors.numpy import load_file
  tensors = load_file(str(export / "model.safetensors"))
  assert {"embeddingHead.weight", "embeddingHead.bias", "norm.weight", "norm.bias"} <= set(tensors)
  # ANCE's reference code: RobertaModel from the folder, then norm(embeddingHead(h_cls)) with torch's LayerNorm.
  roberta = transformers.RobertaModel.from_pretrained(str(export), add_pooling_layer=False).eval()
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(export))
  enc = tokenizer(TEXTS, padding=True, return_tensors="pt")
  with torch.no_grad():
    cls = roberta(**{k: v for k, v in enc.items() if k != "token_type_ids"}).last_hidden_state[:, 0]
    x = torch.nn.functional.linear(cls, torch.tensor(tensors["embeddingHead.weight"]),
                                   torch.tensor(tensors["embeddingHead.bias"]))
    reference = torch.nn.functional.layer_norm(x, (x.shape[-1],), torch.tensor(tensors["norm.weight"]),
                                               torch.tensor(tensors["norm.bias"]), eps=1e-5).numpy()
  diff = float(np.abs(reference - ours).max())
  st_diff = float(np.abs(_st_vectors(export) - ours).max())
  print(f"ance export: reference head vs jdr {diff:.2e}; sentence-transformers vs jdr {st_diff:.2e}")
  assert diff < 1e-5 and st_diff < 1e-5
  # And the exported folder reads back in jdr as what it is.
  from jdr.models import published
  (export / "modules.json").rename(export / "modules.json.off")
  assert published.read(export).family == "ance"


def test_dpr_pair_trains_as_two_towers_and_exports(tmp_path, tokenizer_dir):
  q_dir, ctx_dir = dpr_dirs(tmp_path, tokenizer_dir)
  params, export = _train(tmp_path, q_dir, f"model.doc_init_from={ctx_dir}", "model.shared=false")
  assert set(params) == {"query_tower", "doc_tower"}
  for side, folder in (("query", "hf-query"), ("doc", "hf-doc")):
    ours, _ = _jdr_vectors(export, side)
    diff = float(np.abs(_st_vectors(export / folder) - ours).max())
    print(f"dpr {side} export: sentence-transformers vs jdr max abs diff {diff:.2e}")
    assert diff < 1e-5


def test_sentence_transformers_model_with_prompts_trains_and_exports(tmp_path, tokenizer_dir):
  params, export = _train(tmp_path, st_dir(tmp_path, tokenizer_dir))
  description = json.loads((export / "jdr_model.json").read_text())
  assert description["prompts"] == {"query": "query: ", "doc": "passage: "}
  assert description["query"]["projection_activation"] == "tanh"
  ours, runtime = _jdr_vectors(export, "doc")  # the model's own prompt, put before each text by jdr
  assert runtime.info["prompt"] == "passage: "
  diff = float(np.abs(_st_vectors(export, prompt_name="document") - ours).max())
  print(f"sentence-transformers export (Dense tanh + Normalize): max abs diff {diff:.2e}")
  assert diff < 1e-5


def test_modernbert_trains_and_exports(tmp_path, tokenizer_dir):
  model = _tiny(transformers.ModernBertModel(transformers.ModernBertConfig(
      vocab_size=30522, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=40,
      max_position_embeddings=128, local_attention=8, pad_token_id=0)))
  model.save_pretrained(tmp_path / "modernbert")
  params, export = _train(tmp_path, _with_tokenizer(tmp_path / "modernbert", tokenizer_dir), "model.pooling=mean")
  ours, _ = _jdr_vectors(export, "doc")
  assert json.loads((export / "config.json").read_text())["model_type"] == "modernbert"
  diff = float(np.abs(_st_vectors(export) - ours).max())
  print(f"modernbert export: sentence-transformers vs jdr max abs diff {diff:.2e}")
  assert diff < 1e-5


def test_mine_encodes_documents_with_the_document_encoder_of_a_pair(tmp_path, tokenizer_dir):
  """DPR's pair mined as published: queries by the question encoder, the corpus by the context encoder."""
  from jdr import mine
  from jdr.data import formats
  from jdr.data import text
  from jdr.retrieval import encoder_runtime, encodings
  q_dir, ctx_dir = dpr_dirs(tmp_path, tokenizer_dir)
  data = write_tiny_beir(tmp_path / "data", num_docs=16)
  mine.main(["--data", str(data), "--out", str(tmp_path / "mined"), "--retriever", "model", "--model", str(q_dir),
             "--doc-model", str(ctx_dir), "--depth", "4", "--dev-fraction", "0", "--doc-max-length", "64",
             "--query-max-length", "16"])
  emb, ids, _ = encodings.load_embeddings(tmp_path / "mined" / "encoding")
  corpus = formats.read_corpus(data)
  texts = [text.doc_text(corpus[d]) for d in ids]
  runtime = encoder_runtime.load_runtime(str(ctx_dir), side="doc", max_length=64, dtype="float32")
  np.testing.assert_allclose(np.asarray(emb), encoder_runtime.encode_texts(runtime, texts), atol=1e-5)
  question = encoder_runtime.load_runtime(str(q_dir), side="doc", max_length=64, dtype="float32")
  assert np.abs(np.asarray(emb) - encoder_runtime.encode_texts(question, texts)).max() > 1e-3
