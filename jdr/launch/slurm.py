"""A SLURM job of one command on every host (or every GPU): an sbatch script whose tasks find the
coordinator from the node list.

  python -m jdr.launch.slurm --nodes 2 --gpus-per-node 8 [--per gpu|host] [--partition P] [--time 24:00:00]
      [--setup "source .venv/bin/activate"] [--script job.sbatch] [--dry-run] -- python -m jdr.train ...

`--per host` (the default, JAX's usual layout) runs one task per node that sees all its GPUs; `--per gpu`
runs one task per GPU with CUDA_VISIBLE_DEVICES set to its local rank. Each task exports JDR_COORDINATOR (the
first node of the allocation, --port), JDR_NUM_PROCESSES (SLURM_NTASKS) and JDR_PROCESS_ID (SLURM_PROCID),
which jdr.runtime.parallel.initialize_distributed reads. Without --dry-run the script is written and submitted with
sbatch; with it, the script and the sbatch command are printed.
"""

from __future__ import annotations

import argparse
import pathlib
import shlex
import subprocess
import sys

from jdr import launch


def sbatch_script(command: list[str], *, nodes: int, gpus_per_node: int, per: str, port: int,
                  partition: str | None, time: str | None, job_name: str, setup: str | None) -> str:
  tasks_per_node = gpus_per_node if per == "gpu" else 1
  lines = ["#!/bin/bash", f"#SBATCH --job-name={job_name}", f"#SBATCH --nodes={nodes}",
           f"#SBATCH --ntasks-per-node={tasks_per_node}", f"#SBATCH --gpus-per-node={gpus_per_node}",
           "#SBATCH --output=%x-%j.out"]
  if partition:
    lines.append(f"#SBATCH --partition={partition}")
  if time:
    lines.append(f"#SBATCH --time={time}")
  task = ['export JDR_COORDINATOR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' + f':{port}"',
          'export JDR_NUM_PROCESSES="$SLURM_NTASKS"', 'export JDR_PROCESS_ID="$SLURM_PROCID"']
  if per == "gpu":
    task.append('export CUDA_VISIBLE_DEVICES="$SLURM_LOCALID"')
  if setup:
    task.append(setup)
  task.append("exec " + shlex.join(command))
  lines += ["set -euo pipefail", "", "srun --kill-on-bad-exit=1 bash -c " + shlex.quote("; ".join(task))]
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jdr.launch.slurm", description=__doc__.splitlines()[0])
  parser.add_argument("--nodes", type=int, required=True)
  parser.add_argument("--gpus-per-node", type=int, default=8)
  parser.add_argument("--per", choices=["host", "gpu"], default="host")
  parser.add_argument("--port", type=int, default=12355)
  parser.add_argument("--partition", default=None)
  parser.add_argument("--time", default=None)
  parser.add_argument("--job-name", default="jdr")
  parser.add_argument("--setup", default=None, help="shell run by every task before the command")
  parser.add_argument("--script", default="jdr-job.sbatch", help="where the sbatch script is written")
  parser.add_argument("--dry-run", action="store_true")
  launch.add_command(parser)
  args = parser.parse_args(argv)
  command = launch.command_of(parser, args)
  script = sbatch_script(command, nodes=args.nodes, gpus_per_node=args.gpus_per_node, per=args.per,
                         port=args.port, partition=args.partition, time=args.time, job_name=args.job_name,
                         setup=args.setup)
  submit = ["sbatch", args.script]
  if args.dry_run:
    print(f"# {args.script}\n{script}\n$ {shlex.join(submit)}")
    return 0
  pathlib.Path(args.script).write_text(script)
  return subprocess.run(submit, check=False).returncode


if __name__ == "__main__":
  sys.exit(main())
