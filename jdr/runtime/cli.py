"""What jdr's command lines share: expected errors become one `error: ...` line and exit status 2.

Library code raises exceptions (a malformed data file is a `formats.DataFormatError` whose text is
"FILE:LINE: reason"); only a command line's `main()` turns them into an exit status, through

  with cli.reporting_errors(skip_flag="--skip-invalid"):
    ...

so a user sees what is wrong and where, not a Python traceback, and a script sees status 2 (what
argparse uses for a bad command line). Set JDR_TRACEBACK=1 to get the traceback anyway.
"""

import argparse
import contextlib
import os
import sys
from typing import Iterator

from jdr.retrieval import encoder_runtime
from jdr.data import formats

# What a user can cause and fix: bad or missing files, settings that disagree. Anything else is a bug
# and keeps its traceback.
EXPECTED_ERRORS = (ValueError, OSError)


def add_skip_invalid_flag(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--skip-invalid", action="store_true",
                      help="drop malformed records of the input files (counted on stderr) instead of stopping")


def describe(e: Exception) -> str:
  """An expected error as its `error:` line reads."""
  if isinstance(e, OSError) and e.filename is not None and e.strerror:
    return f"{e.filename}: {e.strerror}"  # not "[Errno 2] No such file or directory: '...'"
  return str(e)


def exit_now(code: int) -> None:
  """Flushes and ends the process without interpreter shutdown, after a failed orbax write (whose line is
  printed): its writer threads can otherwise print a traceback on an event loop that shutdown closes."""
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


def end_progress_bars() -> None:
  """Closes the progress bars still open, each ending its line, so an `error:` line printed next starts a line
  of its own (`grep ^error:` finds it in a log)."""
  import tqdm  # pylint: disable=g-import-not-at-top
  for bar in list(getattr(tqdm.tqdm, "_instances", ())):
    bar.close()


@contextlib.contextmanager
def reporting_errors(skip_flag: str | None = None) -> Iterator[None]:
  """Turns expected errors raised inside into `error: ...` on stderr and SystemExit(2).

  `skip_flag` names the option that skips bad records, if the command line has one: it is suggested
  after a data-format error.
  """
  try:
    yield
  except EXPECTED_ERRORS as e:
    if os.environ.get("JDR_TRACEBACK"):
      raise
    end_progress_bars()
    print(f"error: {describe(e)}", file=sys.stderr)
    if isinstance(e, formats.DataFormatError) and skip_flag and e.line is not None:
      print(f"(rerun with {skip_flag} to drop the invalid records and go on; each is counted on stderr)",
            file=sys.stderr)
    raise SystemExit(2) from None


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
                           "model.dtype; a trained jdr model keeps its own)")
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
