"""The optimizer: optax AdamW with warmup + cosine decay and global-norm clipping."""
import dataclasses

import jax
import optax


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  learning_rate: float
  warmup_steps: int
  weight_decay: float
  max_grad_norm: float
  beta1: float
  beta2: float
  epsilon: float
  min_learning_rate_ratio: float


def learning_rate_schedule(cfg: OptimizerConfig, num_train_steps: int) -> optax.Schedule:
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=cfg.learning_rate,
      warmup_steps=cfg.warmup_steps,
      decay_steps=max(num_train_steps, cfg.warmup_steps + 1),
      end_value=cfg.learning_rate * cfg.min_learning_rate_ratio,
  )


def decay_mask(params):
  """Decay matrices (kernels, embeddings), never biases or LayerNorm scales.

  Decided by name, not rank: stacked (scanned) layers make biases 2-D.
  """
  return jax.tree_util.tree_map_with_path(
      lambda path, _: getattr(path[-1], "key", None) in ("kernel", "embedding"), params)


def make_optimizer(cfg: OptimizerConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
  clip = optax.clip_by_global_norm(cfg.max_grad_norm) if cfg.max_grad_norm > 0 else optax.identity()
  return optax.chain(
      clip,
      optax.adamw(schedule, b1=cfg.beta1, b2=cfg.beta2, eps=cfg.epsilon,
                  weight_decay=cfg.weight_decay, mask=decay_mask),
  )
