"""Train a dense retriever: `python -m jdr.train --config configs/X.py[:arg] --workdir DIR [--config.k=v]`.

One trainer for every method (jdr/training/trainer.py): which towers train, where negatives come from and which
loss is used are config values (see configs/base.py), never a fork of it.

Exit status: 0 done; 2 bad input or settings, or a checkpoint that could not be written (one `error:` line);
3 a non-finite loss or gradient norm (one `error:` line naming the step; nothing holding it was saved, and the
run resumes from the last good checkpoint); 143 / 130 stopped by SIGTERM / SIGINT after a saved step.
"""

from jdr.runtime import host_memory

# `python -m` this module: glibc's malloc on huge pages, by re-executing before anything heavy is imported.
host_memory.reexec_if_command(__name__)

import argparse
import sys

import jax

from jdr.runtime import checkpoint
from jdr.runtime import cli
from jdr.runtime import config_files
from jdr.runtime import parallel
from jdr.runtime import paths
from jdr.runtime import workdir_lock
from jdr.training import preemption
from jdr.training import sizing


from jdr.training import trainer


def main(argv=None) -> None:
  argv = sys.argv[1:] if argv is None else list(argv)
  try:
    rest, overrides = config_files.split_config_args(argv)
    from jdr.runtime import config_help  # pylint: disable=g-import-not-at-top
    parser = argparse.ArgumentParser(
        prog="python -m jdr.train", description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config keys, set with --config.KEY=VALUE (the defaults of jdr/runtime/defaults.py; a recipe changes "
               "some):\n" + config_help.describe())
    parser.add_argument("--config", required=True, help="configs/X.py[:arg]")
    parser.add_argument("--workdir", default=None, help="checkpoints, logs; an existing one resumes")
    parser.add_argument("--force", action="store_true",
                        help="run even when another live run holds --workdir (refused by default)")
    parser.add_argument("--compile-only", action="store_true",
                        help="compile the step for the configured mesh and print its per-device memory and FLOPs "
                             "(jdr/training/sizing.py); no data is read and nothing trains")
    parser.add_argument("--topology", default=None,
                        help="with --compile-only: compile for this TPU slice's devices instead of the local ones, "
                             "e.g. v5e:2x2 or v4:2x2x1 (ahead of time, from any host with libtpu installed), or for "
                             "the GPUs of one host: h100, h200:8 (from any host with jax's CUDA plugin)")
    args = parser.parse_args(rest)
    if args.topology and not args.compile_only:
      parser.error("--topology goes with --compile-only")
    if not args.workdir and not args.compile_only:
      parser.error("--workdir is required (except with --compile-only)")
    config = config_files.load_config_file(args.config)
    config_files.apply_overrides(config, overrides)
  except config_files.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(2) from None
  # Bad input or settings (a malformed file, ids that do not match, a batch that does not split) are the
  # user's to fix: one line naming the file, the line and the reason, status 2, no traceback.
  with cli.reporting_errors():
    if args.compile_only:
      parallel.use_cpu_devices(trainer.cpu_devices(config))
      parallel.initialize_distributed()
      sizing.report(sizing.size_step(config, topology=args.topology))
      return
    created = not paths.as_path(args.workdir).exists()
    parallel.use_cpu_devices(trainer.cpu_devices(config))  # before jax starts: the lock asks for the process index
    parallel.initialize_distributed()
    try:
      # One run per workdir: a second launch on it refuses before anything is written.
      with workdir_lock.held(args.workdir, "python -m jdr.train " + " ".join(argv), force=args.force,
                             process_index=jax.process_index()), checkpoint.writes_reported(args.workdir):
        trainer.train_and_evaluate(config, args.workdir)
    except preemption.Stopped as stopped:
      preemption.exit_stopped(stopped, argv)
    except BaseException as e:
      if created:
        _remove_unstarted(args.workdir)
      if isinstance(e, KeyboardInterrupt):  # outside the loop, where SIGINT stops after a saved step
        print(f"jdr: interrupted; checkpoints, if any, are in {args.workdir}/checkpoints", file=sys.stderr)
        raise SystemExit(130) from None
      if isinstance(e, checkpoint.WriteError) and __name__ == "__main__":
        print(f"error: {cli.describe(e)}", file=sys.stderr)  # earlier checkpoints stay as they were
        cli.exit_now(2)
      if isinstance(e, checkpoint.NonFiniteError):
        print(f"\nerror: {e}", file=sys.stderr)  # on a line of its own after the progress bar
        raise SystemExit(3) from None
      raise


def _remove_unstarted(workdir: str) -> None:
  """A run that failed before it saved or logged anything leaves no workdir behind (when it made it)."""
  path = paths.as_path(workdir)
  if jax.process_index() != 0 or not path.exists() or (path / "metrics.jsonl").exists():
    return
  if (path / "checkpoints").exists() and any(p.name.isdigit() for p in (path / "checkpoints").iterdir()):
    return
  path.rmtree()

if __name__ == "__main__":
  main()
