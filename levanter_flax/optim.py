"""Optimizers: AdamW, Lion, Adafactor (optax) and Sophia-H, with warmup + cosine decay and clipping."""
import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from levanter_flax import checks
from levanter_flax.schema import STATE, setting


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """The optimizer and its schedule (config.optimizer). A setting the chosen optimizer does not
  read must keep its default. configs/optim/ holds presets (config.load_preset)."""
  learning_rate: float = setting(6e-4, "Peak, after linear warmup; cosine decay follows")
  warmup_steps: int = setting(200, "Steps of linear warmup from 0")
  weight_decay: float = setting(0.1, "Decoupled; never on biases or norms")
  max_grad_norm: float = setting(1.0, "Global-norm clipping; 0 turns it off")
  beta1: float = setting(0.9, "First-moment decay")
  beta2: float = setting(0.95, "Second-moment decay")
  epsilon: float = setting(1e-8, "Added to the update's denominator")
  min_learning_rate_ratio: float = setting(0.1, "The final learning rate as a fraction of the "
                                           "peak")
  name: str = setting("adamw", "A key of optim.OPTIMIZERS: adamw, lion, adafactor or sophia_h",
                      STATE)
  hessian_update_interval: int = setting(10, "sophia_h: steps between Hessian estimates (the "
                                         "paper's k)")
  sophia_gamma: float = setting(0.01, "sophia_h: the Hessian's scale in the update's "
                                "denominator (the paper's gamma)")

  def __post_init__(self):
    checks.ranges(self, "optimizer", {
        "learning_rate": checks.above(0),
        "warmup_steps": checks.at_least(0),
        "min_learning_rate_ratio": checks.unit(),
        "weight_decay": checks.at_least(0),
        "max_grad_norm": checks.at_least(0, "0: no clipping"),
        "beta1": checks.unit(high_open=True),
        "beta2": checks.unit(high_open=True),
        "epsilon": checks.above(0),
        "hessian_update_interval": checks.at_least(1),
        "sophia_gamma": checks.above(0)})


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


def _adamw(cfg: OptimizerConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
  return optax.adamw(schedule, b1=cfg.beta1, b2=cfg.beta2, eps=cfg.epsilon,
                     weight_decay=cfg.weight_decay, mask=decay_mask)


def _lion(cfg: OptimizerConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
  return optax.lion(schedule, b1=cfg.beta1, b2=cfg.beta2, weight_decay=cfg.weight_decay,
                    mask=decay_mask)


def _adafactor(cfg: OptimizerConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
  # Its second-moment decay is a schedule of its own (1 - t^-0.8), and its step is relative
  # to each parameter's scale: learning rates near 1e-2 are usual. optax adds its decay
  # after the learning rate, so it is scaled here to stay decoupled weight decay
  # (lr * weight_decay * param), as in AdamW.
  return optax.adafactor(
      schedule, weight_decay_mask=decay_mask,
      weight_decay_rate=(lambda count: cfg.weight_decay * schedule(count)) if cfg.weight_decay else None)


def _sophia_h(cfg: OptimizerConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
  return sophia_h(schedule, b1=cfg.beta1, b2=cfg.beta2, gamma=cfg.sophia_gamma, eps=cfg.epsilon,
                  weight_decay=cfg.weight_decay, update_interval=cfg.hessian_update_interval)


@dataclasses.dataclass(frozen=True)
class Optimizer:
  build: Callable[[OptimizerConfig, optax.Schedule], optax.GradientTransformation]
  keys: tuple[str, ...]  # The OptimizerConfig fields it reads besides SHARED_KEYS.


# What every optimizer reads: its name, the schedule and the clipping.
SHARED_KEYS = ("name", "learning_rate", "warmup_steps", "min_learning_rate_ratio", "max_grad_norm")
OPTIMIZERS = {
    "adamw": Optimizer(_adamw, ("weight_decay", "beta1", "beta2", "epsilon")),
    "lion": Optimizer(_lion, ("weight_decay", "beta1", "beta2")),
    "adafactor": Optimizer(_adafactor, ("weight_decay",)),
    "sophia_h": Optimizer(_sophia_h, ("weight_decay", "beta1", "beta2", "epsilon", "sophia_gamma",
                                      "hessian_update_interval")),
}


def ignored_keys(name: str) -> tuple[str, ...]:
  """The OptimizerConfig fields that the optimizer `name` does not read."""
  return tuple(f.name for f in dataclasses.fields(OptimizerConfig)
               if f.name not in SHARED_KEYS + OPTIMIZERS[name].keys)


def make_optimizer(cfg: OptimizerConfig, schedule: optax.Schedule) -> optax.GradientTransformationExtraArgs:
  """Clipping, then the named optimizer. Its update takes `loss_fn` (params -> loss) as an extra
  argument, which only sophia_h uses."""
  clip = optax.clip_by_global_norm(cfg.max_grad_norm) if cfg.max_grad_norm > 0 else optax.identity()
  return optax.chain(clip, OPTIMIZERS[cfg.name].build(cfg, schedule))


def hessian_diagonal_estimate(loss_fn: Callable[[Any], jax.Array], params: Any, u: Any) -> Any:
  """Hutchinson's u * (H u): its mean over Rademacher u is the Hessian's diagonal."""
  _, hessian_u = jax.jvp(jax.grad(loss_fn), (params,), (u,))
  return jax.tree.map(jnp.multiply, u, hessian_u)


def rademacher_like(key: jax.Array, tree: Any) -> Any:
  leaves, structure = jax.tree.flatten(tree)
  keys = jax.random.split(key, len(leaves))
  return structure.unflatten([jax.random.rademacher(k, x.shape, x.dtype)
                              for k, x in zip(keys, leaves)])


class SophiaState(NamedTuple):
  count: jax.Array
  key: jax.Array
  momentum: Any
  hessian: Any


def sophia_h(learning_rate: optax.ScalarOrSchedule, *, b1: float = 0.965, b2: float = 0.99,
             gamma: float = 0.01, eps: float = 1e-12, weight_decay: float = 0.1,
             update_interval: int = 10, clip_threshold: float = 1.0,
             seed: int = 0) -> optax.GradientTransformationExtraArgs:
  """Sophia with Hutchinson Hessian estimates (Liu et al., 2023, Algorithm 1).

  m = b1 m + (1 - b1) g every step; every `update_interval` steps
  h = b2 h + (1 - b2) u * (H u) on the loss `loss_fn` passed to update.
  The step is lr * clip(m / max(gamma h, eps), clip_threshold), plus decoupled
  weight decay lr * weight_decay * param on the decay_mask's parameters.
  """
  schedule = learning_rate if callable(learning_rate) else (lambda _: learning_rate)

  def init(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    # A raw uint32 key: orbax checkpoints it like any array.
    return SophiaState(jnp.zeros([], jnp.int32), jax.random.PRNGKey(seed), zeros, zeros)

  def update(grads, state, params=None, *, loss_fn=None, **unused_extra_args):
    if params is None or loss_fn is None:
      raise ValueError("sophia_h needs params and loss_fn= in update()")
    momentum = optax.tree.update_moment(grads, state.momentum, b1, 1)
    key, sample_key = jax.random.split(state.key)
    hessian = jax.lax.cond(
        state.count % update_interval == 0,
        lambda: optax.tree.update_moment(
            hessian_diagonal_estimate(loss_fn, params, rademacher_like(sample_key, params)),
            state.hessian, b2, 1),
        lambda: state.hessian)
    lr = schedule(state.count)
    steps = jax.tree.map(
        lambda m, h: jnp.clip(m / jnp.maximum(gamma * h, eps), -clip_threshold, clip_threshold),
        momentum, hessian)
    decay = decay_mask(params)
    updates = jax.tree.map(lambda s, p, d: -lr * (s + (weight_decay * p if d else 0.0)),
                           steps, params, decay)
    return updates, SophiaState(optax.safe_increment(state.count), key, momentum, hessian)

  return optax.GradientTransformationExtraArgs(init, update)
