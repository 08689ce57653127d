"""jdr.runtime.host_memory: which `python -m jdr...` processes re-execute with huge-page malloc, and that they do."""

import os
import subprocess
import sys

import pytest

from jdr.runtime import host_memory

ARGV = ["python", "-m", "jdr.train", "--config", "c.py"]


def test_a_jdr_command_line_gets_the_tunable_added_to_the_users_own():
  env, why = host_memory.reexec_plan(ARGV, {"PATH": "/bin"}, (2, 36), "madvise")
  assert env == {"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"} and "re-executing" in why
  env, _ = host_memory.reexec_plan(ARGV, {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, (2, 40), "always")
  assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
  env, _ = host_memory.reexec_plan(["python", "-m", "jdr"], {}, (2, 35), "madvise")
  assert env is not None


@pytest.mark.parametrize("argv,environ,glibc,thp,reason", [
    (ARGV, {"JDR_HUGE_PAGE_MALLOC": "0"}, (2, 36), "madvise", "JDR_HUGE_PAGE_MALLOC=0"),
    (ARGV, {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, (2, 36), "madvise", "already sets"),
    (ARGV, {}, (2, 34), "madvise", "glibc 2.35"),
    (ARGV, {}, None, "madvise", "glibc 2.35"),
    (ARGV, {}, (2, 36), "never", "huge pages are off"),
    (ARGV, {}, (2, 36), None, "huge pages are off"),
    (["python", "-m", "pytest"], {}, (2, 36), "madvise", "not a `python -m jdr"),
    (["python", "-m", "jdrx.train"], {}, (2, 36), "madvise", "not a `python -m jdr"),
    (["python", "script.py"], {}, (2, 36), "madvise", "not a `python -m jdr"),
    (["python", "-m"], {}, (2, 36), "madvise", "not a `python -m jdr"),
])
def test_everything_else_goes_on_as_it_is(argv, environ, glibc, thp, reason):
  env, why = host_memory.reexec_plan(argv, environ, glibc, thp)
  assert env is None and reason in why


def test_a_library_import_never_reexecutes():
  # This process imported jdr and its commands as a library: still the same process, tunables untouched.
  from jdr import train  # pylint: disable=g-import-not-at-top,unused-import
  host_memory.reexec_if_command("jdr.train")  # returns: not run as __main__
  import jdr  # pylint: disable=g-import-not-at-top
  assert "reexec" not in open(jdr.__file__).read()  # importing the package does nothing but define names


def test_python_m_jdr_runs_with_huge_page_malloc_where_the_machine_has_it():
  env, why = host_memory.reexec_plan(["python", "-m", "jdr.bench"], dict(os.environ), host_memory.glibc_version(),
                                     host_memory.transparent_huge_pages())
  if env is None and "already sets" not in why:
    pytest.skip(f"this host runs jdr without huge-page malloc: {why}")
  # The command line's own arguments and exit status survive the re-execution.
  proc = subprocess.run([sys.executable, "-m", "jdr.bench", "no-such-benchmark"], capture_output=True, text=True,
                        timeout=120, check=False)
  assert proc.returncode == 2 and "invalid choice: 'no-such-benchmark'" in proc.stderr
  assert "host malloc: transparent huge pages" in proc.stderr and "glibc.malloc.hugetlb=1" in proc.stderr
  off = subprocess.run([sys.executable, "-m", "jdr.bench", "-h"], capture_output=True, text=True, timeout=120,
                       check=True, env={**os.environ, "JDR_HUGE_PAGE_MALLOC": "0", "GLIBC_TUNABLES": ""})
  assert "host malloc: 4 KiB pages (JDR_HUGE_PAGE_MALLOC=0)" in off.stderr
