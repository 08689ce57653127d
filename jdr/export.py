"""Export trained towers for serving: `python -m jdr.export --workdir DIR --out OUT`.

The export is one folder that can be copied anywhere (every path in it is relative to it). From the latest
checkpoint of a training workdir it writes:
  OUT/jdr_model.json + OUT/params/   a params-only orbax checkpoint (no optimizer state), which
                                     `jdr.encode --model OUT` and `jdr.retrieve --model OUT` load;
  OUT/ itself, shared towers or a cross-encoder: a Hugging Face directory (config.json, model.safetensors, the
                                     tokenizer) that transformers.AutoModel (AutoModelForSequenceClassification)
                                     loads and, for an encoder plus pooling (no projection head), the
                                     sentence-transformers files that declare its pooling, normalization and
                                     max_seq_length (and the model's query and document prompts, as
                                     its "query" and "document" prompts), so SentenceTransformer(OUT) loads
                                     it too;
  OUT/hf-query/ + OUT/hf-doc/, separate towers: one such directory per tower (OUT holds the tokenizer).

Serving lengths are recorded apart from the training lengths: a model trained on 32-token queries still reads
a 100-token query whole. By default they are what the encoder supports, up to 512 tokens; --query-max-length
and --doc-max-length set them.
"""

import argparse
import json
import os
import pathlib
import shutil
import sys
import tempfile

import jax
import numpy as np

from jdr.runtime import atomic
from jdr.training import checkpoint
from jdr.runtime import cli
from jdr.runtime import paths
from jdr.models import build as build_lib
from jdr.models import hf
from jdr.models import architectures


def _sentence_transformers_files(path: pathlib.Path, tower: dict, max_length: int, params: dict,
                                 prompts: dict | None = None) -> None:
  """modules.json and the modules' folders: Transformer, Pooling, the tower's head (a Dense, then a LayerNorm
  where the head has one: jdr's and ANCE's head), Normalize; so SentenceTransformer(path) gives jdr's vectors.
  With `prompts` ({"query", "doc"}, either not empty), config_sentence_transformers.json declares them as
  its "query" and "document" prompts, none by default: `encode(texts, prompt_name="query")` (or
  `encode_query`) gives jdr's query vectors, prompt_name="document" (`encode_document`) its documents'."""
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  modules = [("", "sentence_transformers.models.Transformer"), ("1_Pooling", "sentence_transformers.models.Pooling")]
  hidden = tower["encoder"]["hidden_size"]
  (path / "1_Pooling").mkdir(exist_ok=True)
  (path / "1_Pooling" / "config.json").write_text(json.dumps({
      "word_embedding_dimension": hidden,
      "pooling_mode_cls_token": tower["pooling"] == "cls",
      "pooling_mode_mean_tokens": tower["pooling"] == "mean",
      "pooling_mode_max_tokens": tower["pooling"] == "max"}, indent=2))
  dim = tower.get("projection_dim")
  if dim:
    folder = f"{len(modules)}_Dense"
    (path / folder).mkdir(exist_ok=True)
    activation = {"identity": "torch.nn.modules.linear.Identity",
                  "tanh": "torch.nn.modules.activation.Tanh"}[tower.get("projection_activation", "identity")]
    (path / folder / "config.json").write_text(json.dumps({
        "in_features": hidden, "out_features": dim, "bias": tower.get("projection_bias", True),
        "activation_function": activation}, indent=2))
    dense = {"linear.weight": np.ascontiguousarray(np.asarray(params["projection"]["kernel"], np.float32).T)}
    if "bias" in params["projection"]:
      dense["linear.bias"] = np.asarray(params["projection"]["bias"], np.float32)
    save_file(dense, str(path / folder / "model.safetensors"), metadata={"format": "pt"})
    modules.append((folder, "sentence_transformers.models.Dense"))
    if tower.get("projection_norm", True):
      folder = f"{len(modules)}_LayerNorm"
      (path / folder).mkdir(exist_ok=True)
      # sentence-transformers' LayerNorm is torch's, epsilon 1e-5: ANCE's; jdr's own head on a BERT uses
      # BERT's 1e-12, which differs from it by ~5e-6 relative where the head's variance is ~1.
      (path / folder / "config.json").write_text(json.dumps({"dimension": dim}))
      norm = {"norm.weight": np.asarray(params["projection_norm"]["scale"], np.float32),
              "norm.bias": np.asarray(params["projection_norm"]["bias"], np.float32)}
      save_file(norm, str(path / folder / "model.safetensors"), metadata={"format": "pt"})
      modules.append((folder, "sentence_transformers.models.LayerNorm"))
  if tower["normalize"]:
    modules.append((f"{len(modules)}_Normalize", "sentence_transformers.models.Normalize"))
  (path / "modules.json").write_text(json.dumps(
      [{"idx": i, "name": str(i), "path": folder, "type": kind} for i, (folder, kind) in enumerate(modules)],
      indent=2))
  (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_length}))
  if prompts and any(prompts.values()):
    (path / "config_sentence_transformers.json").write_text(json.dumps({
        "prompts": {"query": prompts.get("query", ""), "document": prompts.get("doc", "")},
        "default_prompt_name": None}, indent=2))


def _head_tensors(tower: dict, params: dict) -> dict:
  """ANCE's and DRhard's names for a Dense + LayerNorm head (`embeddingHead`, `norm`), which their code
  (RobertaDot, pyserini's AnceEncoder) and jdr read back; {} for a tower without one."""
  if not tower.get("projection_dim") or not tower.get("projection_norm", True):
    return {}
  head = {"embeddingHead.weight": np.asarray(params["projection"]["kernel"], np.float32).T.copy(),
          "norm.weight": np.asarray(params["projection_norm"]["scale"], np.float32),
          "norm.bias": np.asarray(params["projection_norm"]["bias"], np.float32)}
  if "bias" in params["projection"]:
    head["embeddingHead.bias"] = np.asarray(params["projection"]["bias"], np.float32)
  return head


def serving_lengths(description: dict, query_max_length: int | None = None,
                    doc_max_length: int | None = None) -> dict:
  """{"serve_query_max_length", "serve_doc_max_length"} (a cross-encoder: {"serve_max_length"}, its pair
  length): the lengths asked for, else what each tower supports, up to 512; refused past the positions."""
  if description.get("architecture") == "cross_encoder":
    towers = {"": ({"encoder": description["encoder"]}, doc_max_length or query_max_length)}
  else:
    towers = {"query_": (description["query"], query_max_length), "doc_": (description["doc"], doc_max_length)}
  out = {}
  for prefix, (tower, asked) in towers.items():
    limit = architectures.config_from_saved(tower["encoder"]).max_length if tower.get("encoder") else None
    if asked is not None and (asked < 1 or (limit and asked > limit)):
      raise ValueError(f"a serving length of {asked} tokens: the {prefix.strip('_') or 'pair'} encoder takes 1 to "
                       f"{limit} tokens")
    out[f"serve_{prefix}max_length"] = int(asked or build_lib.supported_length(tower))
  return out


def sentence_transformers_max_length(description: dict, side: str) -> int:
  """The max_seq_length a Hugging Face export declares for one side's tower: its serving length.

  A shared tower also embeds documents, so the document length governs it: declaring the query length would
  make sentence-transformers cut documents at it. A description without serving lengths (from before they were
  recorded) declares the training document length or the base model's (description["base_max_length"], e.g.
  256 for MiniLM) when longer, capped at the positions.
  """
  length_side = "doc" if description["shared"] else side
  if f"serve_{length_side}_max_length" in description:
    return int(description[f"serve_{length_side}_max_length"])
  length = max(int(description[f"{length_side}_max_length"]), int(description.get("base_max_length") or 0))
  return min(length, architectures.config_from_saved(description[side]["encoder"]).max_length)


def export(workdir: paths.PathLike, out: paths.PathLike, *, query_max_length: int | None = None,
           doc_max_length: int | None = None):
  """Writes the params-only checkpoint and the Hugging Face files; returns `out`.

  The files are written to a temporary folder beside `out` (on object storage: on local disk, then uploaded)
  and put in place once all are written, so a failure (a full disk) leaves no partial export behind; an
  existing export at `out` is replaced."""
  lengths = {"query_max_length": query_max_length, "doc_max_length": doc_max_length}
  if not paths.is_local(out):
    with tempfile.TemporaryDirectory(prefix="jdr-export-") as tmp:
      _export(workdir, pathlib.Path(tmp), **lengths)
      paths.upload_dir(tmp, out)
    return paths.as_path(out)
  out = pathlib.Path(out)
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = pathlib.Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
  try:
    _export(workdir, tmp, **lengths)
    os.chmod(tmp, 0o777 & ~atomic.UMASK)  # mkdtemp's 0700 would hide the export from the umask's readers
    if out.exists():
      old = out.with_name(f".{out.name}.old.{os.getpid()}")
      out.rename(old)
      tmp.rename(out)
      shutil.rmtree(old)
    else:
      tmp.rename(out)
  except BaseException as e:
    atomic.remove_tree(tmp)
    errno = atomic.os_error_code(e)
    if errno is not None:
      raise OSError(errno, os.strerror(errno), str(out)) from None  # "error: OUT: No space left on device"
    raise
  return out


def _export(workdir: paths.PathLike, out: pathlib.Path, *, query_max_length: int | None = None,
            doc_max_length: int | None = None) -> pathlib.Path:
  model, params, tokenizer, description = build_lib.load_jdr_model(workdir)
  out.mkdir(parents=True, exist_ok=True)
  tokenizer.save_pretrained(str(out))
  description = {**description, "tokenizer": ".",  # the export's own folder, wherever it is copied
                 **serving_lengths(description, query_max_length, doc_max_length)}
  params = jax.device_get(params)
  checkpoint.save_params(out, params, description)
  if description.get("architecture") == "cross_encoder":
    from jdr.models import cross  # pylint: disable=g-import-not-at-top
    cross.export_cross_encoder(model.config, params, out, max_length=description["serve_max_length"])
    print(f"serving length: {description['serve_max_length']} tokens a (query, document) pair (trained at "
          f"{description.get('max_length')})", file=sys.stderr)
    return out
  print(f"serving lengths: queries {description['serve_query_max_length']} tokens, documents "
        f"{description['serve_doc_max_length']} (trained at {description['query_max_length']} and "
        f"{description['doc_max_length']}; set with --query-max-length / --doc-max-length)", file=sys.stderr)
  sides = {".": ("tower", "query")} if model.shared else {
      "hf-query": ("query_tower", "query"), "hf-doc": ("doc_tower", "doc")}
  for folder, (param_key, side) in sides.items():
    tower = description[side]
    if tower.get("kind", "transformer") != "transformer":
      print(f"{side} tower is {tower['kind']}: no Hugging Face equivalent, skipped", file=sys.stderr)
      continue
    encoder = getattr(model, side).encoder
    head = _head_tensors(tower, params[param_key])
    # With a head, the safetensors take the layout of ANCE's / DRhard's RobertaDot (the base model under its
    # prefix, beside embeddingHead and norm): transformers.AutoModel still reads the encoder from it.
    prefix = {"roberta": "roberta.", "bert": "bert."}.get(encoder.model_type, "") if head else ""
    path = hf.export_hf(encoder, params[param_key]["encoder"], out / folder,
                        tokenizer=None if folder == "." else tokenizer, prefix=prefix, extra_tensors=head,
                        architecture="RobertaDot" if head and encoder.model_type == "roberta" else None)
    _sentence_transformers_files(path, tower, sentence_transformers_max_length(description, side),
                                 params[param_key], description.get("prompts"))
  return out


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jdr.export", description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", required=True, help="a training workdir (its latest checkpoint)")
  parser.add_argument("--out", required=True, help="output directory (replaced if it exists)")
  parser.add_argument("--query-max-length", type=int, default=None,
                      help="tokens per query when serving (default: what the encoder supports, up to 512)")
  parser.add_argument("--doc-max-length", type=int, default=None,
                      help="tokens per document when serving (default: what the encoder supports, up to 512)")
  args = parser.parse_args(argv)
  try:
    with cli.reporting_errors():
      if not paths.as_path(args.workdir).is_dir():
        raise FileNotFoundError(f"--workdir {args.workdir}: no such directory")
      out = export(args.workdir, args.out, query_max_length=args.query_max_length,
                   doc_max_length=args.doc_max_length)
  except SystemExit as stop:
    if __name__ != "__main__":
      raise
    cli.exit_now(stop.code if isinstance(stop.code, int) else 2)  # the partial export is already gone
  print(f"exported {args.workdir} to {out}", file=sys.stderr)


if __name__ == "__main__":
  main()
