"""Learning-rate schedules (optimizer.schedule), each a linear warmup from 0 over
optimizer.warmup_steps, then its own shape, built from optax's schedule builders.

A schedule is a pure function of (step, trainer.num_train_steps): a resume with another
num_train_steps follows the new run's schedule from the checkpoint's step on. WSD's stable phase
depends on num_train_steps only through where its decay starts, so a WSD run resumed with a
larger num_train_steps before its decay began goes on at the peak.
"""
import dataclasses
from typing import Callable

import jax.numpy as jnp
import optax

from levanter_flax.core.errors import UserError

DECAY_SHAPES = ("linear", "sqrt")


def _warmup_then(cfg, after: optax.Schedule, more: tuple[optax.Schedule, ...] = (),
                 boundaries: tuple[int, ...] = ()) -> optax.Schedule:
  """Linear warmup from 0 to the peak over warmup_steps, then `after` (and `more` from each of
  `boundaries`), each counting its steps from where it starts."""
  warmup = optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps)
  return optax.join_schedules([warmup, after, *more], [cfg.warmup_steps, *boundaries])


def _end_value(cfg) -> float:
  return cfg.learning_rate * cfg.min_learning_rate_ratio


def cosine(cfg, num_train_steps: int) -> optax.Schedule:
  """Cosine decay from the peak to the end value at num_train_steps."""
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
      decay_steps=max(num_train_steps, cfg.warmup_steps + 1), end_value=_end_value(cfg))


def linear(cfg, num_train_steps: int) -> optax.Schedule:
  """Linear decay from the peak to the end value at num_train_steps."""
  decay_steps = max(num_train_steps - cfg.warmup_steps, 1)
  return _warmup_then(cfg, optax.linear_schedule(cfg.learning_rate, _end_value(cfg), decay_steps))


def constant(cfg, num_train_steps: int) -> optax.Schedule:
  """The peak, from the end of the warmup on."""
  del num_train_steps
  return _warmup_then(cfg, optax.constant_schedule(cfg.learning_rate))


def wsd_decay_steps(cfg, num_train_steps: int) -> int:
  """The steps of WSD's decay, the last decay_fraction of num_train_steps (at least one)."""
  return max(round(cfg.decay_fraction * num_train_steps), 1)


def sqrt_decay(peak: float, end: float, decay_steps: int) -> optax.Schedule:
  """end + (peak - end) * (1 - sqrt(t)), t = step / decay_steps in [0, 1] (Hägele et al., 2024,
  "Scaling Laws and Compute-Optimal Training Beyond Fixed Training Durations"); optax has no
  builder for it (its polynomial schedule is (1 - t)^power)."""
  def schedule(step):
    t = jnp.clip(step / decay_steps, 0.0, 1.0)
    return end + (peak - end) * (1.0 - jnp.sqrt(t))
  return schedule


def wsd(cfg, num_train_steps: int) -> optax.Schedule:
  """Warmup, stable at the peak, then decay_shape's decay to the end value over the last
  decay_fraction of num_train_steps."""
  decay_steps = wsd_decay_steps(cfg, num_train_steps)
  decay_start = num_train_steps - decay_steps
  if decay_start < cfg.warmup_steps:
    raise UserError(f"config.optimizer.warmup_steps ({cfg.warmup_steps}) must end by the start of "
                    f"WSD's decay, step {decay_start}: the last optimizer.decay_fraction "
                    f"({cfg.decay_fraction}) of trainer.num_train_steps ({num_train_steps}); "
                    f"lower either, or train longer")
  if cfg.decay_shape == "sqrt":
    decay = sqrt_decay(cfg.learning_rate, _end_value(cfg), decay_steps)
  else:
    decay = optax.linear_schedule(cfg.learning_rate, _end_value(cfg), decay_steps)
  return _warmup_then(cfg, optax.constant_schedule(cfg.learning_rate), (decay,), (decay_start,))


@dataclasses.dataclass(frozen=True)
class Schedule:
  build: Callable[..., optax.Schedule]  # (OptimizerConfig, num_train_steps) -> schedule
  keys: tuple[str, ...]  # The OptimizerConfig fields it reads besides learning_rate, warmup_steps.


SCHEDULES = {
    "cosine": Schedule(cosine, ("min_learning_rate_ratio",)),
    "wsd": Schedule(wsd, ("min_learning_rate_ratio", "decay_fraction", "decay_shape")),
    "linear": Schedule(linear, ("min_learning_rate_ratio",)),
    "constant": Schedule(constant, ()),
}
