"""The optax optimizer a config asks for: AdamW or LAMB, warm-up then linear decay, masked weight decay.

`lamb` is the LAMB that the dense-retrieval authors trained with, rewritten as optax transformations: the
`Lamb` class of jingtaozhan/DRhard's `lamb.py` (STAR's `--optimizer_str lamb`, `star/train.py`), the same
file as microsoft/ANCE's `utils/lamb.py` (`drivers/run_ann.py`); both come from cybertronai/pytorch-lamb.
Per parameter tensor, with m and v the moving averages of the gradient and its square:

* the moments are not debiased: the step is m / (sqrt(v) + eps) (their comment: "Paper v3 does not use
  debiasing"; the bias-correction factor is commented out of the step size);
* weight decay is added to that step, `wd * w`, before the trust ratio, so the ratio also scales it;
* the trust ratio is min(||w||, 10) / ||step||, the weight norm clamped at 10 (`.clamp(0, 10)`);
* the ratio is 1 when either norm is 0 (a zero weight such as a fresh bias, or a zero step);
* the weight moves by -lr * ratio * step, the learning rate from the schedule.

Every tensor gets the trust ratio, weight decay only the matrices: STAR's two parameter groups put biases
and LayerNorm weights at weight_decay 0, which `decay_mask` reproduces (they are jdr's 1-D parameters).
ANCE's `run_ann.py` groups by layer and passes no weight decay, i.e. `weight_decay=0` here. Both pass
only lr and eps, so b1 and b2 are `Lamb`'s defaults, 0.9 and 0.999, which are also jdr's.

optax's own LAMB (`optax.lamb`, as `optax_lamb`) differs: it debiases the moments and leaves the weight
norm unclamped, so on matrices of norm above 10, most of BERT's, its steps are larger by ||w|| / 10.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax

from jdr.models import decoder

OPTIMIZERS = ("adamw", "lamb", "optax_lamb")


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


def query_only(model_config: ml_collections.ConfigDict) -> bool:
  """Whether only the query tower trains (ADORE / LTRe: `model.train_towers`), the one place it is decided."""
  return trains_query_only(model_config.train_towers)


def trains_query_only(train_towers: str) -> bool:
  if train_towers not in ("both", "query"):
    raise ValueError(f"model.train_towers must be 'both' or 'query', got {train_towers!r}")
  return train_towers == "query"


def uses_lora(model_config: ml_collections.ConfigDict) -> bool:
  """Whether the encoders train through LoRA adapters only (`model.lora_rank` > 0)."""
  return model_config.get("lora_rank", 0) > 0


def _keys(path) -> list[str]:
  return [k.key for k in path if hasattr(k, "key")]


def trainable_labels(params, train_towers: str, lora: bool = False):
  """"train" or "freeze" per parameter: everything trains; or only the query tower (ADORE / LTRe); and with
  `lora`, of an encoder only its LoRA adapters (a head outside the encoder trains)."""
  only_query = trains_query_only(train_towers)
  if only_query and "query_tower" not in params:
    raise ValueError("model.train_towers='query' needs separate towers (model.shared=False)")

  def label(path, _):
    keys = _keys(path)
    if only_query and keys[0] != "query_tower":
      return "freeze"
    if lora and "encoder" in keys and not any(k in decoder.LORA_PARAMS for k in keys):
      return "freeze"
    return "train"

  # tree_map_with_path keeps flax's logical-partitioning boxes, so the labels match boxed params too.
  return jax.tree_util.tree_map_with_path(label, params)


def split_frozen(params, train_towers: str, lora: bool = False):
  """(trained, frozen): two trees shaped like `params`, each with None where the other holds the leaf;
  frozen is None when everything trains. The train step differentiates the first only, so autodiff computes
  no gradient for a frozen parameter at all (a frozen 7B base costs no weight-gradient matmuls), where the
  optimizer's freeze only discards gradients already computed."""
  if not lora and train_towers == "both":
    return params, None
  labels = trainable_labels(params, train_towers, lora)
  pick = lambda wanted: jax.tree.map(lambda p, label: p if label == wanted else None, params, labels)
  return pick("train"), pick("freeze")


def with_zero_gradients(grads, frozen):
  """The gradients of `split_frozen`'s trained tree completed with zeros where `frozen` holds a leaf (what
  the optimizer, which takes the whole tree, discards; XLA never materializes them)."""
  if frozen is None:
    return grads
  return jax.tree.map(lambda g, f: jnp.zeros_like(f) if g is None else g, grads, frozen,
                      is_leaf=lambda x: x is None)


class MomentsState(NamedTuple):
  """The moving averages of the gradient and of its square, each a pytree like the params (and boxed like
  them, so the moments take the params' logical-axis shardings)."""
  mu: optax.Updates
  nu: optax.Updates


def scale_by_undebiased_adam(b1: float, b2: float, eps: float) -> optax.GradientTransformation:
  """Adam's step m / (sqrt(v) + eps) from moments that are never debiased, as the authors' LAMB computes it.

  With a trust ratio after it, debiasing would only rescale each tensor's step, which the ratio undoes, up to
  eps and the weight decay added before the ratio."""

  def init_fn(params):
    return MomentsState(mu=jax.tree.map(jnp.zeros_like, params), nu=jax.tree.map(jnp.zeros_like, params))

  def update_fn(updates, state, params=None):
    del params
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, updates)
    nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * jnp.square(g), state.nu, updates)
    return jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu, nu), MomentsState(mu=mu, nu=nu)

  return optax.GradientTransformation(init_fn, update_fn)


def _norm(x):
  # Summed in at least float32 whatever the params' dtype: bfloat16's 8 bits are too few for a whole matrix.
  return jnp.sqrt(jnp.sum(jnp.square(x.astype(jnp.promote_types(x.dtype, jnp.float32)))))


def scale_by_clamped_trust_ratio(max_weight_norm: float = 10.0) -> optax.GradientTransformation:
  """Scales each tensor's step u by min(||w||, max_weight_norm) / ||u||, or by 1 where either norm is 0."""

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError("the trust ratio needs the params: pass them to update")

    def scale(u, w):
      weight_norm, step_norm = jnp.minimum(_norm(w), max_weight_norm), _norm(u)
      either_zero = (weight_norm == 0) | (step_norm == 0)
      # The inner where keeps 0 / 0 out of the program, so no NaN is computed even in the branch not taken.
      ratio = jnp.where(either_zero, 1.0, weight_norm / jnp.where(either_zero, 1.0, step_norm))
      return (u * ratio).astype(u.dtype)

    return jax.tree.map(scale, updates, params), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def lamb(learning_rate: optax.ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6,
         weight_decay: float = 0.0, mask=None, max_weight_norm: float = 10.0) -> optax.GradientTransformation:
  """The authors' LAMB (see the module docstring); its defaults are their `Lamb`'s. `mask` picks the
  tensors that weight decay touches; every tensor gets the trust ratio."""
  return optax.chain(
      scale_by_undebiased_adam(b1, b2, eps),
      optax.add_decayed_weights(weight_decay, mask),
      scale_by_clamped_trust_ratio(max_weight_norm),
      optax.scale_by_learning_rate(learning_rate),
  )


def schedule_steps(cfg: ml_collections.ConfigDict, train_steps: int) -> int:
  """The step where the learning rate reaches 0: `optimizer.schedule_steps`, or the run's own length when 0.

  Two numbers because the authors' runs have two: their schedule spans the run they planned (DRhard's STAR 100
  epochs, ANCE's max_steps of 1M, ADORE's 6 epochs), while the paper reports the model at an earlier step,
  where the rate is still well above 0. A schedule that ended before training did would leave steps at rate 0."""
  total = int(cfg.get("schedule_steps", 0)) or train_steps
  if total < train_steps:
    raise ValueError(f"optimizer.schedule_steps={total} is below num_train_steps={train_steps}: the steps after it "
                     "would train at learning rate 0 (0 = end the schedule with the run)")
  return total


def make_optimizer(cfg: ml_collections.ConfigDict, total_steps: int, train_towers: str = "both",
                   lora: bool = False) -> optax.GradientTransformation:
  """Builds the optimizer of `config.optimizer` for a run of `total_steps` steps (its schedule spans
  `schedule_steps(cfg, total_steps)`). Frozen parameters (a query-only run's document tower, the encoder under
  LoRA) get no optimizer state: optax.multi_transform gives the inner optimizer only the trained ones."""
  schedule = learning_rate_schedule(cfg.learning_rate, cfg.warmup_steps, schedule_steps(cfg, total_steps))
  if cfg.name == "adamw":
    tx = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                     mask=decay_mask)
  elif cfg.name == "lamb":
    tx = lamb(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask)
  elif cfg.name == "optax_lamb":
    tx = optax.lamb(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                    mask=decay_mask)
  else:
    raise ValueError(f"optimizer.name must be one of {', '.join(map(repr, OPTIMIZERS))}, got {cfg.name!r}")
  if cfg.grad_clip_norm:
    tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip_norm), tx)
  if train_towers != "both" or lora:
    tx = optax.multi_transform({"train": tx, "freeze": optax.set_to_zero()},
                               lambda params: trainable_labels(params, train_towers, lora))
  return tx
