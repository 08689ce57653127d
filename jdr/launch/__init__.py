"""Launchers: the same `python -m jdr.train ...` on every process of a job (jdr.parallel.initialize_distributed
joins them). `python -m jdr.launch.local`, `python -m jdr.launch.slurm`, `python -m jdr.launch.tpu`; each has
`--dry-run`, which prints the exact commands instead of running them."""
