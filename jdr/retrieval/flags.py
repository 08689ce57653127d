"""The command-line flags that choose a tower to encode with (`jdr.encode`, `jdr.retrieve`, `jdr.mine`): the model,
its pooling, normalization, length, dtype, width and batch size, and each side's prompt; what they mean is
`encoder_runtime.load_runtime`'s."""

import argparse

from jdr.retrieval import encoder_runtime


def add_model_flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--model", default=None,
                      help="a published model directory or Hugging Face hub id (owner/name), a jdr export or "
                           "workdir, or `minilm` (bundled)")
  parser.add_argument("--pooling", choices=["cls", "mean", "max", "last"], default=None,
                      help="default: the model's own (mean for minilm, cls otherwise)")
  parser.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                      help="L2-normalize embeddings (default: the model's own)")
  parser.add_argument("--max-length", type=int, default=None,
                      help="tokens per text (default: a jdr export's serving length, a sentence-transformers "
                           "model's max_seq_length, else what the model supports, up to 512)")
  parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                      help="compute dtype of the encoder (auto: bfloat16 on GPU/TPU, float32 on CPU, as training's "
                           "model.dtype; a trained jdr model keeps its own). bfloat16 on a CPU with AVX512-BF16 or "
                           "AMX runs its matmuls on those instructions: 1.6x float32's docs/s for MiniLM on an AVX-512 "
                           "AMD EPYC, vectors at cosine 0.99998 to float32's (docs/performance.md, encode)")
  parser.add_argument("--dim", type=int, default=None,
                      help="serve the vectors' first D dimensions, re-normalized where the model normalizes: a "
                           "Matryoshka model's smaller embedding (one of the widths it was trained at, "
                           "loss.matryoshka_dims); default: all")
  parser.add_argument("--tokens-per-batch", type=int, default=None,
                      help="padded tokens per batch; the batch size follows from each length bucket "
                           f"(default {encoder_runtime.CPU_TOKENS_PER_BATCH} on CPU, "
                           f"{encoder_runtime.ACCELERATOR_TOKENS_PER_BATCH} on GPU/TPU)")


def add_prompt_flags(parser: argparse.ArgumentParser, *sides: str) -> None:
  """--query-prompt and/or --doc-prompt (`sides`: "query", "doc"): the text put before every query / document,
  replacing the model's own (None, the default: the model's own; "" = none)."""
  texts = {"query": "query", "doc": "document"}
  for side in sides:
    parser.add_argument(encoder_runtime.PROMPT_FLAGS[side], dest=f"{side}_prompt", default=None,
                        help=f"text put before every {texts[side]} before tokenizing (its tokens count toward "
                             f"the length), e.g. E5's \"{'query' if side == 'query' else 'passage'}: \"; default: "
                             "the model's own (a jdr model's, a sentence-transformers directory's prompts); \"\" = "
                             "none")
