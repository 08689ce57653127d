"""A TPU VM slice: the same command on every worker through the cloud CLI, after setting each worker up.

  python -m jdr.launch.tpu --tpu NAME --zone ZONE [--project P] [--workers 4] [--repo-dir ~/jdr]
      [--copy .] [--setup "pip install -e '.[tpu]'"] [--dry-run] -- python -m jdr.train ...

Steps (each a `gcloud compute tpus tpu-vm` command on --worker=all): copy the working tree (--copy DIR, optional),
set up the environment (--setup), then run the command in --repo-dir. On a TPU VM, jax.distributed finds the
other workers by itself (jdr.runtime.parallel.initialize_distributed), so the command is the single-host one.
--dry-run prints the commands, and what each of the --workers workers runs.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys

from jdr import launch


def commands(command: list[str], *, tpu: str, zone: str, project: str | None, repo_dir: str, copy: str | None,
             setup: str | None) -> list[list[str]]:
  base = ["gcloud", "compute", "tpus", "tpu-vm"]
  where = ["--zone", zone] + (["--project", project] if project else [])
  out = []
  if copy:
    out.append(base + ["scp", "--recurse", copy, f"{tpu}:{repo_dir}", "--worker=all", *where])
  remote = f"cd {repo_dir}"
  if setup:
    out.append(base + ["ssh", tpu, "--worker=all", *where, "--command", f"{remote} && {setup}"])
  out.append(base + ["ssh", tpu, "--worker=all", *where, "--command", f"{remote} && {shlex.join(command)}"])
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jdr.launch.tpu", description=__doc__.splitlines()[0])
  parser.add_argument("--tpu", required=True, help="the TPU VM (slice) name")
  parser.add_argument("--zone", required=True)
  parser.add_argument("--project", default=None)
  parser.add_argument("--workers", type=int, default=None, help="for --dry-run: how many workers to show")
  parser.add_argument("--repo-dir", default="~/jdr", help="the working tree's directory on each worker")
  parser.add_argument("--copy", default=None, help="a local directory to copy to --repo-dir first")
  parser.add_argument("--setup", default=None, help="shell run on every worker before the command")
  parser.add_argument("--dry-run", action="store_true")
  launch.add_command(parser)
  args = parser.parse_args(argv)
  command = launch.command_of(parser, args)
  steps = commands(command, tpu=args.tpu, zone=args.zone, project=args.project, repo_dir=args.repo_dir,
                   copy=args.copy, setup=args.setup)
  if args.dry_run:
    for step in steps:
      print("$ " + shlex.join(step))
    for worker in range(args.workers or 0):
      print(f"# worker {worker}: cd {args.repo_dir} && {shlex.join(command)}  (jax.distributed: process {worker} "
            f"of {args.workers})")
    return 0
  for step in steps:
    code = subprocess.run(step, check=False).returncode
    if code:
      return code
  return 0


if __name__ == "__main__":
  sys.exit(main())
