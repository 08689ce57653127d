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
    # A data-format error (jdr.data.formats.DataFormatError) carries the file's line: the records can be skipped.
    if getattr(e, "line", None) is not None and skip_flag:
      print(f"(rerun with {skip_flag} to drop the invalid records and go on; each is counted on stderr)",
            file=sys.stderr)
    raise SystemExit(2) from None
