"""The optax optimizer a config asks for: AdamW or LAMB, warm-up then linear decay, masked weight decay."""

import jax
import ml_collections
import optax


def learning_rate_schedule(peak: float, warmup_steps: int, total_steps: int) -> optax.Schedule:
  """Linear warm-up from 0 to `peak`, then linear decay to 0 at `total_steps` (BERT / LTRe / STAR)."""
  warmup_steps = max(0, min(warmup_steps, total_steps))
  decay = optax.linear_schedule(peak, 0.0, max(1, total_steps - warmup_steps))
  if warmup_steps == 0:
    return decay
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup_steps), decay], [warmup_steps])


def decay_mask(params):
  """True for weight matrices and embedding tables; biases and LayerNorm (all 1-D) are not decayed."""
  return jax.tree.map(lambda p: p.ndim > 1, params)


def trainable_labels(params, train_towers: str):
  """"train" or "freeze" per parameter: everything trains, or only the query tower (ADORE / LTRe)."""
  if train_towers not in ("both", "query"):
    raise ValueError(f"model.train_towers must be 'both' or 'query', got {train_towers!r}")
  if train_towers == "query" and "query_tower" not in params:
    raise ValueError("model.train_towers='query' needs separate towers (model.shared=False)")

  def label(path, _):
    return "train" if train_towers == "both" or path[0].key == "query_tower" else "freeze"

  # tree_map_with_path keeps flax's logical-partitioning boxes, so the labels match boxed params too.
  return jax.tree_util.tree_map_with_path(label, params)


def make_optimizer(cfg: ml_collections.ConfigDict, total_steps: int,
                   train_towers: str = "both") -> optax.GradientTransformation:
  """Builds the optimizer of `config.optimizer` for a run of `total_steps` steps."""
  schedule = learning_rate_schedule(cfg.learning_rate, cfg.warmup_steps, total_steps)
  if cfg.name == "adamw":
    tx = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                     mask=decay_mask)
  elif cfg.name == "lamb":
    tx = optax.lamb(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                    mask=decay_mask)
  else:
    raise ValueError(f"optimizer.name must be 'adamw' or 'lamb', got {cfg.name!r}")
  if cfg.grad_clip_norm:
    tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip_norm), tx)
  if train_towers != "both":
    tx = optax.multi_transform({"train": tx, "freeze": optax.set_to_zero()},
                               lambda params: trainable_labels(params, train_towers))
  return tx
