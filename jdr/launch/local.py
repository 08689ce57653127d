"""N processes of one command on the local host, joined by jax.distributed with the coordinator on localhost.

  python -m jdr.launch.local --processes 2 [--devices-per-process 4] [--port 0] [--dry-run] -- \
      python -m jdr.train --config configs/inbatch.py --workdir runs/x

Each process gets JDR_COORDINATOR=127.0.0.1:PORT, JDR_NUM_PROCESSES and JDR_PROCESS_ID (what
jdr.runtime.parallel.initialize_distributed reads); `--devices-per-process D` also simulates D CPU devices per process
(XLA's host platform device count, added to the XLA_FLAGS already set), so a multi-host run can be tried on
one machine. Process 0's output is shown; the others write to --log-dir (default: a temporary directory, named
at the end).
The exit status is the first non-zero one of the processes.
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import subprocess
import sys
import tempfile

from jdr import launch


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def xla_flags_with_devices(flags: str, devices: int) -> str:
  """An XLA_FLAGS value that asks for `devices` simulated CPU devices: an earlier count is replaced and every
  other flag kept (a user's dump or optimization flags reach each launched process)."""
  kept = [f for f in flags.split() if not f.startswith(DEVICE_COUNT_FLAG + "=")]
  return " ".join([*kept, f"{DEVICE_COUNT_FLAG}={devices}"])


def process_envs(processes: int, port: int, devices_per_process: int | None) -> list[dict[str, str]]:
  """The variables each process adds to the environment."""
  out = []
  for rank in range(processes):
    env = {"JDR_COORDINATOR": f"127.0.0.1:{port}", "JDR_NUM_PROCESSES": str(processes),
           "JDR_PROCESS_ID": str(rank)}
    if devices_per_process:
      env.update(JAX_PLATFORMS="cpu",
                 XLA_FLAGS=xla_flags_with_devices(os.environ.get("XLA_FLAGS", ""), devices_per_process))
    out.append(env)
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jdr.launch.local", description=__doc__.splitlines()[0])
  parser.add_argument("--processes", type=int, required=True)
  parser.add_argument("--devices-per-process", type=int, default=None,
                      help="simulate this many CPU devices in each process (testing multi-host on one machine)")
  parser.add_argument("--port", type=int, default=0, help="coordinator port (0 = a free one)")
  parser.add_argument("--log-dir", default=None, help="where processes 1..N-1 write their output")
  parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
  launch.add_command(parser)
  args = parser.parse_args(argv)
  command = launch.command_of(parser, args)
  if args.processes < 1:
    parser.error("--processes must be >= 1")
  port = args.port or free_port()
  envs = process_envs(args.processes, port, args.devices_per_process)
  if args.dry_run:
    for env in envs:
      print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(command))
    return 0
  log_dir = args.log_dir or tempfile.mkdtemp(prefix="jdr-launch-")
  os.makedirs(log_dir, exist_ok=True)
  procs, logs = [], []
  for rank, env in enumerate(envs):
    out = None
    if rank:
      out = open(os.path.join(log_dir, f"process-{rank}.log"), "w")
      logs.append(out)
    procs.append(subprocess.Popen(command, env={**os.environ, **env}, stdout=out, stderr=out))
  codes = [p.wait() for p in procs]
  for f in logs:
    f.close()
  if args.processes > 1:
    print(f"processes 1-{args.processes - 1} logged to {log_dir}", file=sys.stderr)
  return next((c for c in codes if c), 0)


if __name__ == "__main__":
  sys.exit(main())
