"""One benchmark in a process of its own, as `python -m jdr.bench ARGS` runs it (its malloc settings included):
the suites that compare runs start each one fresh, so none inherits another's threads, caches or XLA flags."""

import json
import subprocess
import sys


def run(args: list[str], env: dict[str, str] | None = None) -> dict:
  """The last JSON line of `python -m jdr.bench ARGS` (in environment `env`, else this one's), its stderr passed
  through as it comes."""
  done = subprocess.run([sys.executable, "-m", "jdr.bench", *args], stdout=subprocess.PIPE, text=True, check=False,
                        env=env)
  lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
  if done.returncode or not lines:
    return {"error": f"`python -m jdr.bench {' '.join(args)}` exited {done.returncode} with "
                     f"{'no JSON line' if not lines else 'an error'}"}
  return json.loads(lines[-1])
