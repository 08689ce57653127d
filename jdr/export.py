"""Export trained towers for serving: `python -m jdr.export --workdir DIR --out OUT`.

Writes, from the latest checkpoint of a training workdir:
  OUT/jdr_model.json + OUT/params/   a params-only orbax checkpoint (no optimizer state), which
                                     `jdr.encode --model OUT` and `jdr.retrieve --model OUT` load;
  OUT/hf/ (shared towers) or OUT/hf-query/ + OUT/hf-doc/ (separate towers): Hugging Face directories that
                                     transformers.AutoModel loads, with the tokenizer and, when the tower is
                                     an encoder plus pooling (no projection head), the sentence-transformers
                                     files that declare its pooling, normalization and max_seq_length (the
                                     document length it was trained for, or the base model's if longer).
"""

import argparse
import json
import pathlib
import sys
import tempfile

import jax

from jdr import checkpoint
from jdr import cli
from jdr import paths
from jdr.models import build as build_lib
from jdr.models import hf
from jdr.models.bert import EncoderConfig


def _sentence_transformers_files(path: pathlib.Path, tower: dict, max_length: int) -> None:
  modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
             {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
  if tower["normalize"]:
    modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                    "type": "sentence_transformers.models.Normalize"})
  (path / "modules.json").write_text(json.dumps(modules, indent=2))
  (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_length}))
  (path / "1_Pooling").mkdir(exist_ok=True)
  hidden = tower["encoder"]["hidden_size"]
  (path / "1_Pooling" / "config.json").write_text(json.dumps({
      "word_embedding_dimension": hidden,
      "pooling_mode_cls_token": tower["pooling"] == "cls",
      "pooling_mode_mean_tokens": tower["pooling"] == "mean",
      "pooling_mode_max_tokens": tower["pooling"] == "max"}, indent=2))


def sentence_transformers_max_length(description: dict, side: str) -> int:
  """The max_seq_length a Hugging Face export declares for one side's tower.

  A shared tower also embeds documents, so the document length governs it: declaring the query
  length would make sentence-transformers cut documents at it. The base model's declared length
  (description["base_max_length"], e.g. 256 for MiniLM) is kept when longer, capped at the positions.
  """
  length_side = "doc" if description["shared"] else side
  length = max(int(description[f"{length_side}_max_length"]), int(description.get("base_max_length") or 0))
  return min(length, EncoderConfig(**description[side]["encoder"]).max_length)


def export(workdir: paths.PathLike, out: paths.PathLike):
  """Writes the params-only checkpoint and the Hugging Face directories; returns `out`.

  `out` may be on object storage (gs://...): the Hugging Face files are then written locally first (their
  writers take local paths only) and uploaded; the tokenizer path recorded in jdr_model.json is `out`'s."""
  if not paths.is_local(out):
    with tempfile.TemporaryDirectory(prefix="jdr-export-") as tmp:
      _export(workdir, pathlib.Path(tmp), tokenizer_at=paths.as_path(out) / "tokenizer")
      paths.upload_dir(tmp, out)
    return paths.as_path(out)
  return _export(workdir, pathlib.Path(out))


def _export(workdir: paths.PathLike, out: pathlib.Path, tokenizer_at=None) -> pathlib.Path:
  model, params, tokenizer, description = build_lib.load_jdr_model(workdir)
  out.mkdir(parents=True, exist_ok=True)
  tokenizer.save_pretrained(str(out / "tokenizer"))
  description = {**description, "tokenizer": str(tokenizer_at or (out / "tokenizer").absolute())}
  params = jax.device_get(params)
  checkpoint.save_params(out, params, description)
  if description.get("architecture") == "cross_encoder":
    from jdr.models import cross  # pylint: disable=g-import-not-at-top
    cross.export_cross_encoder(model.config, params, out / "hf", tokenizer=tokenizer,
                               max_length=description.get("max_length"))
    return out
  sides = {"hf": ("tower", "query")} if model.shared else {
      "hf-query": ("query_tower", "query"), "hf-doc": ("doc_tower", "doc")}
  for folder, (param_key, side) in sides.items():
    tower = description[side]
    if tower.get("kind", "transformer") != "transformer":
      print(f"{side} tower is {tower['kind']}: no Hugging Face equivalent, skipped", file=sys.stderr)
      continue
    path = hf.export_hf(getattr(model, side).encoder, params[param_key]["encoder"], out / folder, tokenizer=tokenizer)
    max_length = sentence_transformers_max_length(description, side)
    if tower.get("projection_dim"):
      print(f"{path}: holds the encoder only; the projection head lives in {out}/params", file=sys.stderr)
    else:
      _sentence_transformers_files(path, tower, max_length)
  return out


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jdr.export", description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", required=True, help="a training workdir (its latest checkpoint)")
  parser.add_argument("--out", required=True, help="output directory")
  args = parser.parse_args(argv)
  with cli.reporting_errors():
    if not paths.as_path(args.workdir).is_dir():
      raise FileNotFoundError(f"--workdir {args.workdir}: no such directory")
    out = export(args.workdir, args.out)
  print(f"exported {args.workdir} to {out}", file=sys.stderr)


if __name__ == "__main__":
  main()
