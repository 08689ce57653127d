"""Paper-size runs, planned: each full recipe at MS MARCO size, its step compiled for the host it would run on,
and the hours of each stage from figures measured before (docs/performance.md, `plan`).

  python -m jdr.bench plan                          # the hours table only: no compiles, seconds
  PYTHONPATH=<jax CUDA plugin> python -m jdr.bench plan --topology h100:8   # and each step compiled for 8 H100s
  PYTHONPATH=<libtpu> python -m jdr.bench plan --topology v5e:2x4           # ... for a TPU v5e slice of 8 chips
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m jdr.bench plan --topology cpu  # 8 CPU devices
  python -m jdr.bench plan --recipes adore,ance --topology h100:8

Compiling (`--topology`) is `python -m jdr.train --config configs/X.py --compile-only` of each recipe's full
(`get_config()`) variant, with one change: its starting model (RoBERTa-base, or a workdir of an earlier stage,
none of which a planning host has) is a fresh BERT-base of the same shape (`model.init_from= model.fresh=base`:
12 x 768, [CLS] + the recipe's head), whose vocabulary is the MiniLM tokenizer's 30,522 where RoBERTa's is
50,265: the 19,743 rows more are 15.2M parameters, 57.8 MiB of float32 parameters, the same again of
gradients and twice that of Adam / LAMB moments per device under data parallelism. ADORE / LTRe compile
against their corpus of 8,841,823 rows (jdr.training.sizing.compile_corpus_step). A compile of a BERT-base step is
slow on a small host (docs/performance.md, `plan`, has the times).

The hours come from the recipe's settings (steps, batch, lengths, negatives, refreshes) and FIGURES, each
measured once with the command it names; a stage whose figure was never measured says so (None) rather than
guess. Device-bound stages are given for one H200 and for an 8-GPU host as one H200's time / 8 (data
parallelism assumed to scale evenly: not measured); host-bound stages (CPU work the accelerators wait for:
preparing the corpus, BM25, Faiss on the host) do not shrink with GPUs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import sys
import time

import ml_collections


@dataclasses.dataclass(frozen=True)
class Figure:
  value: float
  source: str  # where and how it was measured (docs/performance.md has each one's command)


# Every rate the hours are built from. Device figures: one NVIDIA H200, BERT-base-shaped, bf16
# (`python -m jdr.bench device`, docs/performance.md, `device`, "On an NVIDIA H200"); host figures: the 2-core
# x86 CPU.
FIGURES = {
    "encode_docs_per_s": Figure(6_722, "H200, SciFact's 5,183 documents at up to 256 tokens from token ids "
                                       "(`python -m jdr.bench device`, encoding)"),
    "encode_tokens_per_doc": Figure(1_242_251 / 5_183, "SciFact's real tokens a document at up to 256 (same run)"),
    "train_step_s": Figure(0.0834, "H200, in-batch train step, 128 x 32 + 128 x 256 tokens, AdamW, dropout 0.1 "
                                   "(`python -m jdr.bench device`, train)"),
    "train_step_tokens": Figure(128 * 32 + 128 * 256, "that step's tokens"),
    "adore_step_s": Figure(0.01241, "H200, ADORE step with its top-200 retrieved in the step over 8,841,823 x 768 "
                                    "bf16, 32 queries x 32 tokens (`python -m jdr.bench device`, ADORE)"),
    "adore_step_given_s": Figure(0.00904, "H200, the same step given its candidates (same run)"),
    "topk_s": Figure(0.00468, "H200, exact top-200 of 32 queries over 8,841,823 x 768 bf16 (`python -m jdr.bench "
                              "device`, retrieval)"),
    "faiss_flat_s_per_million": Figure(0.769, "2-core x86 CPU, Faiss Flat top-200 of 32 queries per million "
                                              "documents (`python -m jdr.bench adore-step --backends jax,faiss "
                                              "--factories Flat --sizes 1000000 --steps 5`)"),
    "prepare_s": Figure(68.1 + 751.3, "2-core x86 CPU, preparing MS MARCO-shaped 8,841,823 passages: loading "
                                      "them with the index pass (68.1 s) and their token ids at up to 120 tokens "
                                      "(751.3 s), `python -m jdr.bench scale --passages 8841823`"),
    "prepare_tokens_per_doc": Figure(100.2, "the word pieces of those passages (same run)"),
    "bm25_index_s": Figure(722.5, "2-core x86 CPU, jdr.retrieval.bm25's index of those 8,841,823 passages (same run)"),
    "bm25_queries_per_s": Figure(502_939 / 971.0, "2-core x86 CPU, jdr.retrieval.bm25's top-200 of 502,939 queries over "
                                                  "that index in 971.0 s (same run)"),
    "fgd_step_factor": Figure(19.16 / 16.70, "2-core x86 CPU, MiniLM: the FGD step (passage and sentence KD) over "
                                             "the contrastive one (`python -m jdr.bench fgd-step --batch-size 8 "
                                             "--negatives 3 --doc-length 512 --steps 3`)"),
}
QUERIES_PER_SEARCH = 32  # the queries of one measured top-k (topk_s, faiss_flat_s_per_million)
GPUS = 8


@dataclasses.dataclass(frozen=True)
class Corpus:
  name: str
  docs: int
  train_queries: int
  dev_queries: int


MSMARCO_PASSAGE = Corpus("MS MARCO passage", 8_841_823, 502_939, 6_980)
MSMARCO_DOC = Corpus("MS MARCO document", 3_213_835, 367_013, 5_193)

# The full recipes, by their `python -m jdr.train --config` spec; rand_neg, nce_neg and ltre have the step
# shapes of star / inbatch / adore and are planned the same way.
RECIPES = ("inbatch", "rand_neg", "nce_neg", "bm25_rand", "bm25_neg", "star", "ance", "adore", "adore:jax",
           "ltre", "cross_encoder", "fgd:warmup", "fgd")


@dataclasses.dataclass
class Stage:
  name: str  # prepare | mine | train | evaluate
  what: str
  seconds: float | None  # on one H200 (device) or the host; None: a figure it needs was never measured
  formula: str
  bound: str  # "device" | "host"

  def on_host_of(self, gpus: int) -> float | None:
    """Seconds on a host of `gpus` GPUs: device-bound work split evenly (assumed), host-bound work as is."""
    if self.seconds is None:
      return None
    return self.seconds / gpus if self.bound == "device" else self.seconds


def recipe_config(spec: str, configs_dir: pathlib.Path) -> ml_collections.ConfigDict:
  from jdr.runtime import config_files  # pylint: disable=g-import-not-at-top
  name, _, arg = spec.partition(":")
  return config_files.load_config_file(str(configs_dir / f"{name}.py") + (f":{arg}" if arg else ""))


def corpus_of(config: ml_collections.ConfigDict) -> Corpus:
  return MSMARCO_DOC if "msmarco-doc" in str(config.data.dataset) else MSMARCO_PASSAGE


def _f(x: float) -> str:
  return f"{x:,.0f}" if x >= 100 else f"{x:,.3g}"


def _encode(docs: int, doc_tokens: int, corpus: Corpus) -> tuple[float, str]:
  """Seconds to encode `docs` documents of `corpus` at up to `doc_tokens` on one H200, and the formula.
  Encoding batches documents by their real length, so MS MARCO passages (shorter than the SciFact documents the
  rate was measured on, 240 real tokens on average) take the measured rate at any maximum: an upper bound.
  MS MARCO documents fill their `doc_tokens` (FirstP): the rate scaled by tokens, attention's growth past 256
  not counted (a lower bound on the time)."""
  rate, tokens = FIGURES["encode_docs_per_s"].value, FIGURES["encode_tokens_per_doc"].value
  if corpus is not MSMARCO_DOC or doc_tokens <= tokens:
    return docs / rate, f"{docs:,} / {rate:,.0f} docs/s"
  scaled = rate * tokens / doc_tokens
  return docs / scaled, f"{docs:,} / ({rate:,.0f} docs/s x {tokens:.0f} / {doc_tokens} tokens)"


def _prepare(corpus: Corpus, doc_tokens: int) -> tuple[float, str]:
  """Host seconds to prepare the corpus (index pass and token ids), from the 8.84M-passage run: by documents for
  passages; for MS MARCO documents also by the tokens they fill, tokenizing being most of it (a)."""
  per_doc = FIGURES["prepare_s"].value / MSMARCO_PASSAGE.docs
  passage_tokens = FIGURES["prepare_tokens_per_doc"].value
  if corpus is not MSMARCO_DOC:
    return corpus.docs * per_doc, f"{corpus.docs:,} x {per_doc * 1e6:.1f} s per million passages (a)"
  scale = doc_tokens / passage_tokens
  return (corpus.docs * per_doc * scale,
          f"{corpus.docs:,} x {per_doc * 1e6:.1f} s per million passages x {doc_tokens} / {passage_tokens:.0f} tokens (a)")


def _bm25(corpus: Corpus, queries: int, indexed: bool = False) -> tuple[float | None, str]:
  """Host seconds of BM25's index (unless the negatives built it) and the top-k of `queries`, measured on MS
  MARCO-shaped passages (b); documents were not measured."""
  if corpus is not MSMARCO_PASSAGE:
    return None, "(b)"
  rate, index = FIGURES["bm25_queries_per_s"].value, FIGURES["bm25_index_s"].value
  if indexed:
    return queries / rate, f"{queries:,} / {rate:,.0f} queries/s, the negatives' index (b)"
  return index + queries / rate, f"{index:,.0f} s index + {queries:,} / {rate:,.0f} queries/s (b)"


def _search(queries: int, docs: int) -> tuple[float, str]:
  """Exact top-k of `queries` over `docs` on one H200, 32 queries a search at the 8.84M-row figure (for a
  smaller corpus an upper bound)."""
  t = FIGURES["topk_s"].value
  return math.ceil(queries / QUERIES_PER_SEARCH) * t, f"{queries:,} / 32 x {t * 1e3:.2f} ms"


def _query_encode(queries: int, length: int) -> tuple[float, str]:
  rate = FIGURES["encode_docs_per_s"].value * FIGURES["encode_tokens_per_doc"].value
  return queries * length / rate, f"{queries:,} x {length} tokens / {rate / 1e6:.2f}M tokens/s"


def _dense_mining(config, corpus: Corpus) -> tuple[float, str]:
  """One pass of mining every training query's top n with a model: encode the corpus and the queries, search."""
  enc, enc_f = _encode(corpus.docs, config.eval.doc_max_length or config.data.doc_max_length, corpus)
  qs, qs_f = _query_encode(corpus.train_queries, config.data.query_max_length)
  se, se_f = _search(corpus.train_queries, corpus.docs)
  return enc + qs + se, f"{enc_f} + {qs_f} + {se_f}"


def step_tokens(config: ml_collections.ConfigDict) -> int:
  """Token positions one step runs through the encoders: batches are padded to the maximum lengths."""
  from jdr.negatives import sources  # pylint: disable=g-import-not-at-top
  b, lq, ld, n = (config.batch_size, config.data.query_max_length, config.data.doc_max_length,
                  config.negatives.per_query)
  kind = sources.candidates(config)
  if kind == "pairs":
    return b * (1 + n) * ld
  if kind == "corpus":
    return b * lq
  return b * lq + b * (1 + n) * ld


def stages(config: ml_collections.ConfigDict) -> list[Stage]:
  """Prepare, mine, train and evaluate of a full recipe at its corpus's size (module docstring)."""
  from jdr.negatives import refresh  # pylint: disable=g-import-not-at-top
  from jdr.negatives import retrieved  # pylint: disable=g-import-not-at-top
  from jdr.negatives import sources  # pylint: disable=g-import-not-at-top
  from jdr.training import distill  # pylint: disable=g-import-not-at-top
  corpus, neg = corpus_of(config), config.negatives
  own, depth = sources.section(neg), sources.depth(neg)  # the chosen source's group, its pool depth
  out = []
  # ---- prepare: the corpus tokenized once into memory-mapped arrays (jdr.data.prepared), on the host.
  out.append(Stage("prepare", "index and tokenize", *_prepare(corpus, config.data.doc_max_length), "host"))
  if neg.source == "retrieval":
    s, f = _encode(corpus.docs, config.eval.doc_max_length or config.data.doc_max_length, corpus)
    out.append(Stage("prepare", "encode the fixed index", s, f, "device"))
  # ---- mine
  if neg.source in ("bm25", "bm25_random"):
    out.append(Stage("mine", f"BM25 index, top-{own.top_k} of {corpus.train_queries:,} queries",
                     *_bm25(corpus, corpus.train_queries), "host"))
  elif neg.source == "dense_static":
    s, f = _dense_mining(config, corpus)
    out.append(Stage("mine", f"top-{own.top_n + own.extra}", s, f, "device"))
  elif neg.source == "ance":
    s, f = _dense_mining(config, corpus)
    # Generation 0, then each refresh in force by the last step (the refresher mines no later one).
    passes = 1 + refresh.generation_at(config.num_train_steps - 1, own.refresh_every, own.refresh_delay)
    out.append(Stage("mine", f"{passes} x top-{own.top_n} (the start, then every {own.refresh_every:,} steps)",
                     passes * s, f"{passes} x ({f}) = {passes} x {_f(s)} s", "device"))
  if distill.enabled(config.distill):
    pieces = sum(k * (config.data.query_max_length + size) for (_, size), k in
                 zip(distill.levels(config.distill),
                     distill.piece_counts(config.distill, config.data.doc_max_length).values()))
    pair = min(config.data.query_max_length + config.data.doc_max_length, 512) + pieces
    rate = FIGURES["encode_docs_per_s"].value * FIGURES["encode_tokens_per_doc"].value
    out.append(Stage("mine", "teacher scores", corpus.train_queries * (1 + depth) * pair / rate,
                     f"{corpus.train_queries:,} queries x {1 + depth} documents x {pair:,} tokens (the "
                     f"document and its pieces) / {rate / 1e6:.2f}M tokens/s (c)", "device"))
  # ---- train
  steps = config.num_train_steps
  if neg.source == "retrieval" and not retrieved.settings(own).in_step:
    faiss = FIGURES["faiss_flat_s_per_million"].value * corpus.docs / 1e6
    given = FIGURES["adore_step_given_s"].value
    out.append(Stage("train", "Faiss Flat between steps", steps * (faiss + given),
                     f"{steps:,} x ({faiss:.2f} s on the 2-core CPU + {given * 1e3:.2f} ms step) (d)", "host"))
  elif neg.source == "retrieval":
    t = FIGURES["adore_step_s"].value
    out.append(Stage("train", "top-200 in the step", steps * t, f"{steps:,} x {t * 1e3:.2f} ms (e)", "device"))
  else:
    tokens = step_tokens(config)
    t = FIGURES["train_step_s"].value * tokens / FIGURES["train_step_tokens"].value
    extra = ""
    if distill.enabled(config.distill):
      t *= FIGURES["fgd_step_factor"].value
      extra = f" x {FIGURES['fgd_step_factor'].value:.3f} (f)"
    out.append(Stage("train", f"{tokens:,} tokens a step", steps * t,
                     f"{steps:,} x {FIGURES['train_step_s'].value * 1e3:.1f} ms x {tokens:,} / "
                     f"{FIGURES['train_step_tokens'].value:,.0f}{extra}", "device"))
  # ---- evaluate: before training and at the end (jdr.train; eval_every=0 in every full recipe)
  out.extend(_evaluation(config, corpus))
  return out


def _evaluation(config: ml_collections.ConfigDict, corpus: Corpus) -> list[Stage]:
  from jdr.negatives import sources  # pylint: disable=g-import-not-at-top
  from jdr.training import optimizers  # pylint: disable=g-import-not-at-top
  dev, depth = corpus.dev_queries, config.eval.get("candidates_depth", 100)
  times = 1 + int(config.eval_before_training) + (config.num_train_steps // config.eval_every
                                                   if config.eval_every else 0)
  ld = config.eval.doc_max_length or config.data.doc_max_length
  if sources.candidates(config) == "pairs":
    n = dev * config.eval.rerank_depth
    rate = FIGURES["encode_docs_per_s"].value * FIGURES["encode_tokens_per_doc"].value
    return [Stage("evaluate", f"BM25 top-{config.eval.rerank_depth}", *_bm25(corpus, dev, indexed=False), "host"),
            Stage("evaluate", f"{times} x reranking", times * n * ld / rate,
                  f"{times} x {n:,} pairs x {ld} tokens / {rate / 1e6:.2f}M tokens/s", "device")]
  qs, qs_f = _query_encode(dev, config.data.query_max_length)
  se, se_f = _search(dev, corpus.docs)
  if optimizers.query_only(config.model):  # the fixed index is searched, never re-encoded
    return [Stage("evaluate", f"{times} x the fixed index", times * (qs + se), f"{times} x ({qs_f} + {se_f})",
                  "device")]
  kind = config.eval.get("candidates", "full")
  final, f_final = _encode(corpus.docs, ld, corpus)
  rows = [Stage("evaluate", "full corpus at the end", final + qs + se, f"{f_final} + {dev:,} queries", "device")]
  periodic = times - 1
  if kind == "auto":
    kind = "full" if dev * depth >= corpus.docs else "bm25"
  if kind == "bm25" and periodic:
    cand, f_cand = _encode(dev * depth, ld, corpus)
    rows.append(Stage("evaluate", f"BM25 top-{depth}",
                      *_bm25(corpus, dev, indexed=config.negatives.source in ("bm25", "bm25_random")), "host"))
    # The end scores the candidates too, for the curve's last point.
    rows.append(Stage("evaluate", f"{periodic + 1} x BM25 candidates", (periodic + 1) * (cand + qs),
                      f"{periodic + 1} x (at most {f_cand} + {dev:,} queries)", "device"))
  elif periodic:
    rows.append(Stage("evaluate", f"{periodic} x full corpus", periodic * (final + qs + se),
                      f"{periodic} x {_f(final + qs + se)} s", "device"))
  return rows


def settings(config: ml_collections.ConfigDict) -> str:
  """The recipe settings the hours use, in one line."""
  neg, parts = config.negatives, [f"{config.num_train_steps:,} steps", f"batch {config.batch_size}",
                                  f"{config.data.query_max_length} / {config.data.doc_max_length} tokens"]
  if neg.source != "none":
    parts.append(f"negatives {neg.source}" + (f" x {neg.per_query}" if neg.source != "retrieval" else
                                              f" top-{neg.retrieval.top_n} via {neg.retrieval.backend}"))
  if neg.source == "ance":
    parts.append(f"refresh every {neg.ance.refresh_every:,}")
  return ", ".join(parts)


def hours(seconds: float | None) -> str:
  if seconds is None:
    return "not measured"
  return f"{seconds / 3600:,.2f} h" if seconds >= 360 else f"{seconds:,.0f} s"


def cell(parts: list[Stage]) -> str:
  """One stage of one recipe: each part's hours and formula, host-bound parts marked."""
  return "<br>".join(f"{'**host** ' if p.bound == 'host' else ''}{p.what}: {hours(p.seconds)}"
                     + (f" = {p.formula}" if p.seconds is not None else f" {p.formula}") for p in parts) or "-"


def hours_table(configs: dict[str, ml_collections.ConfigDict], gpus: int = GPUS) -> tuple[str, list[dict]]:
  """The Markdown table (a row a recipe, a column a stage, then the totals), and its parts as records."""
  names = ("prepare", "mine", "train", "evaluate")
  lines = ["| recipe (settings) | " + " | ".join(names) + f" | one H200 | {gpus} x H200 |",
           "|---" * (len(names) + 3) + "|"]
  records = []
  for spec, config in configs.items():
    rows = stages(config)
    records += [{"recipe": spec, **dataclasses.asdict(st)} for st in rows]
    known = [st for st in rows if st.seconds is not None]
    missing = f" + {len(rows) - len(known)} not measured" if len(known) < len(rows) else ""
    totals = [f"{hours(sum(st.on_host_of(g) for st in known))}{missing}" for g in (1, gpus)]
    lines.append(f"| `{spec}` ({settings(config)}; {corpus_of(config).name}) | "
                 + " | ".join(cell([st for st in rows if st.name == n]) for n in names)
                 + f" | {totals[0]} | {totals[1]} |")
  return "\n".join(lines), records


def compile_table(results: list[dict], memory: int | None) -> str:
  mib = lambda b: f"{b / 2**20:,.0f}"  # pylint: disable=unnecessary-lambda-assignment
  lines = ["| recipe | batch, tokens | params | optimizer | batch in | temporaries | corpus shard | step total "
           "| of the device |", "|---|---|---|---|---|---|---|---|---|"]
  for r in results:
    s = r["sizes"]
    corpus = "-"
    if s.get("retrieval") == "host":
      corpus = f"0 (host: {s['corpus_host_bytes'] / 2**30:.1f} GiB float32)"
    elif s.get("retrieval"):
      corpus = f"{mib(s['corpus_bytes_per_device'])} ({s['corpus_dtype']})"
    share = f"{s['total_bytes_per_device'] / memory:.0%}" if memory else ""
    lines.append(f"| `{r['recipe']}` | {s['batch_size']}, {s['query_length']} / {s['doc_length']} | "
                 f"{mib(s['params_bytes_per_device'])} | {mib(s['optimizer_bytes_per_device'])} | "
                 f"{s['batch_bytes_per_device'] / 2**20:,.1f} | {mib(s['temp_bytes'])} | {corpus} | "
                 f"{mib(s['total_bytes_per_device'])} | {share} |")
  return "\n".join(lines)


def device_memory(topology: str | None) -> int | None:
  """Bytes of one device of `topology`, for the table's last column (None where unknown)."""
  from jdr.training import sizing  # pylint: disable=g-import-not-at-top
  if not topology or topology == "cpu":
    return None
  gpu = sizing.gpu_target(topology)
  if gpu:
    return sizing.GPU_TARGETS[gpu[0]]["memory"]
  return {"v5e": 16 * 2**30, "v5p": 95 * 2**30, "v4": 32 * 2**30}.get(topology.split(":")[0])


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jdr.bench plan", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated configs/X.py[:arg] names")
  parser.add_argument("--configs", default=str(pathlib.Path(__file__).resolve().parents[2] / "configs"),
                      help="the recipes' folder")
  parser.add_argument("--topology", default=None,
                      help="compile each step too: h100:8 / h200:8 (8 GPUs of a host, needs jax's CUDA plugin), a "
                           "TPU slice such as v5e:2x4 (needs libtpu), or cpu (this host's devices)")
  parser.add_argument("--corpus-rows", type=int, default=MSMARCO_PASSAGE.docs,
                      help="the fixed corpus of ADORE / LTRe's compiled step")
  parser.add_argument("--fresh", default="base", help="the compiled model's shape (model.fresh; tiny to try the "
                                                      "command in seconds)")
  args = parser.parse_args(argv)
  configs = {spec: recipe_config(spec, pathlib.Path(args.configs)) for spec in args.recipes.split(",") if spec}
  table, records = hours_table(configs)
  print(table, file=sys.stderr)
  compiled = []
  if args.topology:
    from jdr.training import sizing  # pylint: disable=g-import-not-at-top
    for spec, config in configs.items():
      config.model.init_from, config.model.fresh = "", args.fresh  # the module docstring says why
      start = time.perf_counter()
      sizes = sizing.size_step(config, topology=None if args.topology == "cpu" else args.topology,
                               corpus_rows=args.corpus_rows)
      compiled.append({"recipe": spec, "compile_s": round(time.perf_counter() - start, 1), "sizes": sizes})
      sizing.report(sizes, file=sys.stderr)
      print(f"{spec}: compiled in {compiled[-1]['compile_s']} s", file=sys.stderr, flush=True)
    print(compile_table(compiled, device_memory(args.topology)), file=sys.stderr)
  print(json.dumps({"benchmark": "plan", "topology": args.topology, "figures": {
      k: dataclasses.asdict(v) for k, v in FIGURES.items()}, "stages": records, "compiled": compiled}))


if __name__ == "__main__":
  main()
