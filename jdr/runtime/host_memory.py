"""Host memory: jdr's command lines run with glibc's malloc backed by transparent huge pages.

XLA's CPU runtime allocates one scratch buffer per execution for all of a computation's intermediates (gigabytes
for a MiniLM train step) and frees it when the step ends. glibc serves an allocation that large with a fresh mmap
and hands it back with munmap, so every step touches every page of it anew, in 4 KiB pages: page faults are a
large part of a CPU step, and far fewer with 2 MiB pages (the figures: docs/performance.md, `train-step`,
"Host memory"). glibc (2.35 and later) does that with the tunable `glibc.malloc.hugetlb=1`
(madvise(MADV_HUGEPAGE) on its mappings), but it reads tunables only when a process starts. So `python -m
jdr.<command>` re-executes itself once, before anything heavy is imported, with the tunable added to
GLIBC_TUNABLES (`reexec_if_command`, at the top of each command's module). Keeping freed memory
instead (M_ARENA_MAX=1, M_MMAP_MAX=0, no trimming, all settable in-process) saved as much time but held two
to three scratch buffers resident, which the long-document FGD steps cannot afford.

Nothing happens when: JDR_HUGE_PAGE_MALLOC=0; GLIBC_TUNABLES already names glibc.malloc.hugetlb (the user's
choice, and what stops a second re-execution); the C library is not glibc >= 2.35; the kernel's transparent
huge pages are off ("[never]"); or the process is not a `python -m jdr...` command line (a library user's
process is never re-executed). Its children (the local launcher's workers) inherit the setting.
`python -m jdr.bench ...` prints `status()` first, so a benchmark's figures say which malloc they ran on.
"""

from __future__ import annotations

import os
import sys

TUNABLE = "glibc.malloc.hugetlb"
OPT_OUT = "JDR_HUGE_PAGE_MALLOC"
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def glibc_version() -> tuple[int, int] | None:
  """(major, minor) of the running glibc, or None where the C library is another one."""
  try:
    name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
  except (ValueError, OSError, AttributeError):
    return None
  if name != "glibc":
    return None
  major, minor = version.split(".")[:2]
  return int(major), int(minor)


def transparent_huge_pages() -> str | None:
  """The kernel's transparent huge page mode ("always", "madvise" or "never"), or None if it has none."""
  try:
    with open(_THP_SETTING, encoding="ascii") as f:
      text = f.read()
  except OSError:
    return None
  start, end = text.find("["), text.find("]")
  return text[start + 1:end] if 0 <= start < end else None


def reexec_plan(orig_argv: list[str], environ: dict[str, str], glibc: tuple[int, int] | None,
                thp: str | None) -> tuple[dict[str, str] | None, str]:
  """(the environment to re-execute with, or None to go on as is; the reason, in words). Pure, for tests."""
  if environ.get(OPT_OUT, "1") == "0":
    return None, f"{OPT_OUT}=0"
  if TUNABLE in environ.get("GLIBC_TUNABLES", ""):
    return None, f"GLIBC_TUNABLES already sets {TUNABLE}"
  if glibc is None or glibc < (2, 35):
    return None, "the C library is not glibc 2.35 or later"
  if thp in (None, "never"):
    return None, "the kernel's transparent huge pages are off"
  try:
    module = orig_argv[orig_argv.index("-m") + 1]
  except (ValueError, IndexError):
    return None, "not a `python -m jdr...` command line"
  if module != "jdr" and not module.startswith("jdr."):
    return None, "not a `python -m jdr...` command line"
  tunables = environ.get("GLIBC_TUNABLES", "")
  env = dict(environ, GLIBC_TUNABLES=f"{tunables}:{TUNABLE}=1" if tunables else f"{TUNABLE}=1")
  return env, f"re-executing with GLIBC_TUNABLES={env['GLIBC_TUNABLES']}"


def reexec_if_command(module_name: str) -> None:
  """Re-executes this `python -m jdr...` process with huge-page malloc where `reexec_plan` says so.

  Called at the top of each command's module with its `__name__`: only a module run as `__main__` re-executes,
  before JAX or anything heavy is imported and before it has printed anything; importing jdr, or a command's
  module as a library, never does.
  """
  if module_name != "__main__" or not sys.executable:
    return
  env, _ = reexec_plan(list(getattr(sys, "orig_argv", [])), dict(os.environ), glibc_version(),
                       transparent_huge_pages())
  if env is not None:
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def status() -> str:
  """One line: whether this process's malloc uses huge pages, and why not where it does not."""
  tunables = os.environ.get("GLIBC_TUNABLES", "")
  if f"{TUNABLE}=1" in tunables.split(":"):
    return f"host malloc: transparent huge pages (GLIBC_TUNABLES={tunables})"
  env, why = reexec_plan(["python", "-m", "jdr"], dict(os.environ), glibc_version(), transparent_huge_pages())
  if env is not None:
    why = "this process was not started as `python -m jdr...`"
  return f"host malloc: 4 KiB pages ({why})"
