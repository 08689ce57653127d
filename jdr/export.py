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
A decoder tower trained with LoRA (model.lora_rank > 0) is exported merged (adapters folded into the kernels)
as above, and also un-merged, for serving stacks that swap adapters over one base:
  OUT/peft-adapter/                  the adapters as PEFT saves them (adapter_config.json,
                                     adapter_model.safetensors; separate towers: peft-adapter-query/ and
                                     peft-adapter-doc/), which peft.PeftModel.from_pretrained puts on
  OUT/peft-base/                     the base they apply to (config.json, model.safetensors, the tokenizer:
                                     the tower with its adapters dropped, not merged) as transformers.AutoModel
                                     loads it; separate towers on different bases: peft-base-query/ and
                                     peft-base-doc/. adapter_config.json names "../peft-base" (relative to the
                                     adapter folder) as base_model_name_or_path unless --peft-base-model
                                     names another (a hub id the base equals, an absolute path): PEFT's
                                     AutoPeftModel reads a relative one from the working directory, while
                                     PeftModel.from_pretrained(base, adapter folder) does not read it at all.

Serving lengths are recorded apart from the training lengths: a model trained on 32-token queries still reads
a 100-token query whole. By default they are what the encoder supports, up to 512 tokens; --query-max-length
and --doc-max-length set them.
"""

from jdr.runtime import host_memory

# `python -m` this module: glibc's malloc on huge pages, by re-executing before anything heavy is imported.
host_memory.reexec_if_command(__name__)

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
from jdr.runtime import checkpoint
from jdr.runtime import cli
from jdr.runtime import paths
from jdr.models import build as build_lib
from jdr.models import hf
from jdr.models import architectures


def _sentence_transformers_files(path: pathlib.Path, tower: dict, max_length: int, params: dict,
                                 prompts: dict | None = None, matryoshka_dims: list | None = None) -> None:
  """modules.json and the modules' folders: Transformer, Pooling, the tower's head (a Dense, then a LayerNorm
  where the head has one: jdr's and ANCE's head), Normalize; so SentenceTransformer(path) gives jdr's vectors.
  With `prompts` ({"query", "doc"}, either not empty), config_sentence_transformers.json declares them as
  its "query" and "document" prompts, none by default: `encode(texts, prompt_name="query")` (or
  `encode_query`) gives jdr's query vectors, prompt_name="document" (`encode_document`) its documents'.
  A Matryoshka model's widths (loss.matryoshka_dims) are recorded there as "matryoshka_dims", which
  sentence-transformers does not read: `SentenceTransformer(path, truncate_dim=d)` serves any width, jdr
  (`jdr.encode --model path --dim d`) the recorded ones."""
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
  config = {}
  if prompts and any(prompts.values()):
    config = {"prompts": {"query": prompts.get("query", ""), "document": prompts.get("doc", "")},
              "default_prompt_name": None}
  if matryoshka_dims:
    config["matryoshka_dims"] = [int(d) for d in matryoshka_dims]
  if config:
    (path / "config_sentence_transformers.json").write_text(json.dumps(config, indent=2))


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


def _lora_encoder(encoder) -> bool:
  """Whether a tower's encoder is a decoder carrying LoRA adapters: its export also gets the PEFT folders."""
  return architectures.is_decoder(encoder) and bool(encoder.lora_rank)


def _peft_adapter(encoder, params: dict, path: pathlib.Path, base_model: str) -> pathlib.Path:
  """adapter_config.json + adapter_model.safetensors: the tower's adapters as PEFT saves them, so
  peft.PeftModel.from_pretrained(AutoModel of the base, path) computes what jdr's tower computes."""
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  from jdr.models import decoder  # pylint: disable=g-import-not-at-top
  path.mkdir(parents=True, exist_ok=True)
  (path / "adapter_config.json").write_text(json.dumps(decoder.peft_config(encoder, base_model), indent=2) + "\n")
  save_file(decoder.peft_state_dict(params, encoder), str(path / "adapter_model.safetensors"),
            metadata={"format": "pt"})
  return path


def _peft_base(encoder, base: dict, path: pathlib.Path, tokenizer) -> pathlib.Path:
  """The tower's params without its adapters (`base`: dropped, not merged; the merged model is the export's own
  Hugging Face folder) as transformers.AutoModel loads them: what the PEFT adapter goes on."""
  return hf.export_hf(encoder.replace(lora_rank=0), base, path, tokenizer=tokenizer)


def _same_base(first: dict, second: dict) -> bool:
  """Whether two towers' frozen bases hold the same weights (separate towers LoRA-tuned from one model), so
  one peft-base/ serves both adapters instead of two copies of a 7B model."""
  one, two = jax.tree_util.tree_flatten_with_path(first)[0], jax.tree_util.tree_flatten_with_path(second)[0]
  return len(one) == len(two) and all(p == q and np.array_equal(np.asarray(x), np.asarray(y))
                                      for (p, x), (q, y) in zip(one, two))


def _peft_files(model, params: dict, out: pathlib.Path, tokenizer, base_model: str | None) -> None:
  """The PEFT folders (the module docstring) of every LoRA tower: each adapter, and the base it goes on."""
  sides = {"": ("tower", "query")} if model.shared else {
      "-query": ("query_tower", "query"), "-doc": ("doc_tower", "doc")}
  towers = {suffix: (getattr(model, side).encoder, params[key]["encoder"])
            for suffix, (key, side) in sides.items() if _lora_encoder(getattr(model, side).encoder)}
  if not towers:
    return
  bases = {suffix: architectures.base_without_adapters(encoder_params)
           for suffix, (_, encoder_params) in towers.items()}
  one_base = len(bases) == 1 or _same_base(*bases.values())
  for suffix, (encoder, encoder_params) in towers.items():
    base = "peft-base" if one_base else f"peft-base{suffix}"
    if not one_base or suffix == next(iter(towers)):
      _peft_base(encoder, bases[suffix], out / base, tokenizer)
    _peft_adapter(encoder, encoder_params, out / f"peft-adapter{suffix}", base_model or f"../{base}")
    print(f"LoRA: a PEFT adapter in peft-adapter{suffix}/ over its un-merged base in {base}/ (the Hugging Face "
          f"folder{'s hold' if len(towers) > 1 else ' holds'} the merged model)", file=sys.stderr)


def export(workdir: paths.PathLike, out: paths.PathLike, *, query_max_length: int | None = None,
           doc_max_length: int | None = None, peft_base_model: str | None = None):
  """Writes the params-only checkpoint and the Hugging Face files; returns `out`.

  The files are written to a temporary folder beside `out` (on object storage: on local disk, then uploaded)
  and put in place once all are written, so a failure (a full disk) leaves no partial export behind; an
  existing export at `out` is replaced. `peft_base_model`: what a LoRA export's adapter_config.json names as
  its base (default: the export's own peft-base/, as a path relative to the adapter folder)."""
  lengths = {"query_max_length": query_max_length, "doc_max_length": doc_max_length,
             "peft_base_model": peft_base_model}
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
            doc_max_length: int | None = None, peft_base_model: str | None = None) -> pathlib.Path:
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
                                 params[param_key], description.get("prompts"), description.get("matryoshka_dims"))
  _peft_files(model, params, out, tokenizer, peft_base_model)
  return out


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jdr.export", description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", required=True, help="a training workdir (its latest checkpoint)")
  parser.add_argument("--out", required=True, help="output directory (replaced if it exists)")
  parser.add_argument("--query-max-length", type=int, default=None,
                      help="tokens per query when serving (default: what the encoder supports, up to 512)")
  parser.add_argument("--doc-max-length", type=int, default=None,
                      help="tokens per document when serving (default: what the encoder supports, up to 512)")
  parser.add_argument("--peft-base-model", default=None,
                      help="a LoRA export's adapter_config.json base_model_name_or_path (default: ../peft-base, "
                           "the export's own un-merged base, relative to the adapter folder)")
  args = parser.parse_args(argv)
  try:
    with cli.reporting_errors():
      if not paths.as_path(args.workdir).is_dir():
        raise FileNotFoundError(f"--workdir {args.workdir}: no such directory")
      out = export(args.workdir, args.out, query_max_length=args.query_max_length,
                   doc_max_length=args.doc_max_length, peft_base_model=args.peft_base_model)
  except SystemExit as stop:
    if __name__ != "__main__":
      raise
    cli.exit_now(stop.code if isinstance(stop.code, int) else 2)  # the partial export is already gone
  print(f"exported {args.workdir} to {out}", file=sys.stderr)


if __name__ == "__main__":
  main()
