"""Every refusal a run's config can meet before anything is read, built or written: `validate(config)`.

The trainer calls it once, first. It asks each unit the config chooses to check its own section, in this order:
the loop's intervals, the numeric ranges (and the renamed keys), data.mixture's datasets (each one's inputs and
negatives, jdr/data/mixture.py), the inputs (dataset, model, teacher), eval.suite's tasks, the negatives source
(each group by its own check, jdr/negatives/sources.py), pretraining, gradient caching, distillation, the guide
and the loss. Nothing here starts a JAX backend, so it runs before the mesh and the hosts start up; the one
check that needs the mesh (the batch splitting over it) stays beside it in the trainer.
"""

import ml_collections

from jdr.data import mixture
from jdr.data import pretrain_batches
from jdr.evaluation import suite as suite_lib
from jdr.negatives import sources
from jdr.runtime import config_files
from jdr.runtime import settings
from jdr.training import distill
from jdr.training import guide
from jdr.training import losses
from jdr.training import step as step_lib


def validate(config: ml_collections.ConfigDict) -> list[mixture.Entry]:
  """Refuses `config` at the first problem (a ValueError, a ConfigError for a missing input: one line naming the
  key); returns data.mixture's plan, each dataset with its own config ([] = data.dataset alone)."""
  settings.check_renamed(config)  # an old key name: one line with the new one, before anything reads the config
  check_intervals(config)  # pure: an interval the loop cannot use fails before a workdir, a backend or data
  settings.check(config)  # every numeric setting in its range, before anything is read or written
  # data.mixture: each dataset's own run config, its entry refused here if bad
  mix = mixture.plan(config, sources.SAMPLERS, sources.check)
  config_files.check_inputs(config)  # a missing dataset, model or teacher: one line, before anything is read
  suite_lib.check(config)  # and a missing eval.suite task or split
  sources.check(config)  # the negatives source, each group by its own check (and its files)
  pretrain_batches.check(config)
  candidates = sources.candidates(config)
  step_lib.check_grad_cache(config, candidates)
  distill.check(config.distill, source=config.negatives.source, per_query=config.negatives.per_query,
                architecture=config.model.architecture, data_kind=config.data.kind,
                model_pooling=config.model.pooling, grad_cache_chunk_size=config.grad_cache.chunk_size)
  guide.check(config.negatives.guide, candidates, config.model.architecture)
  losses.make_loss(config.loss)  # an unknown loss fails here, before any data is read
  return mix


# The loop's step intervals: (key, the smallest valid value, what it means). 0 turns off the periodic
# checkpoints and evaluations, as what is due at the end and on a signal still happens; log_every has no "off"
# worth having (the last step is logged anyway, so a long run would show no progress), so 0 is refused.
INTERVALS = (
    ("log_every", 1, "steps between lines of metrics.jsonl"),
    ("checkpoint_every", 0, "steps between checkpoints; 0 = only at the end and on SIGTERM / SIGINT"),
    ("eval_every", 0, "steps between evaluations; 0 = only before training and at the end"),
)


def check_intervals(config: ml_collections.ConfigDict) -> None:
  """Refuses a step interval the loop cannot use (a ValueError naming the key, the value and what is valid)."""
  for key, lowest, meaning in INTERVALS:
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
      raise ValueError(f"{key}={value!r}: must be an integer >= {lowest} ({meaning})")
