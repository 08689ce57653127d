"""Launchers: the same `python -m jdr.train ...` on every process of a job (jdr.runtime.parallel.initialize_distributed
joins them). `python -m jdr.launch.local`, `python -m jdr.launch.slurm`, `python -m jdr.launch.tpu`; each has
`--dry-run`, which prints the exact commands instead of running them."""


def add_command(parser) -> None:
  """The command every process runs, after `--`."""
  parser.add_argument("command", nargs="...", help="-- then the command every process runs")


def command_of(parser, args) -> list[str]:
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if not command:
    parser.error("give the command after --")
  return command
