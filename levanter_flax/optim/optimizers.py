"""Optimizers: AdamW, Lion, Adafactor, Muon (optax) and Sophia-H, with clipping, on the schedule
of optimizer.schedule (schedules.py)."""
import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from levanter_flax.core import checks
from levanter_flax.optim import schedules
from levanter_flax.core.errors import UserError
from levanter_flax.parallel.partitioning import path_name
from levanter_flax.core.schema import STATE, setting


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """The optimizer and its schedule (config.optimizer). A setting that neither the chosen
  optimizer nor the chosen schedule reads must keep its default. configs/optim/ holds presets
  (config.load_preset)."""
  learning_rate: float = setting(6e-4, "Peak, after linear warmup; the schedule follows")
  warmup_steps: int = setting(200, "Steps of linear warmup from 0")
  schedule: str = setting("cosine", "After the warmup, a key of schedules.SCHEDULES: cosine or "
                          "linear decay to the end value at num_train_steps, constant, or wsd "
                          "(warmup-stable-decay)")
  decay_fraction: float = setting(0.2, "wsd: the decay's share of num_train_steps, at the end")
  decay_shape: str = setting("linear", "wsd: the decay, linear or sqrt: end + (peak - end) * "
                             "(1 - sqrt(t)), t from 0 to 1 through the decay")
  weight_decay: float = setting(0.1, "Decoupled; never on biases or norms")
  max_grad_norm: float = setting(1.0, "Global-norm clipping; 0 turns it off")
  beta1: float = setting(0.9, "First-moment decay")
  beta2: float = setting(0.95, "Second-moment decay")
  epsilon: float = setting(1e-8, "Added to the update's denominator")
  min_learning_rate_ratio: float = setting(0.1, "The end value of a decaying schedule as a "
                                           "fraction of the peak")
  name: str = setting("adamw", "A key of optim.OPTIMIZERS: adamw, lion, adafactor, sophia_h or "
                      "muon", STATE)
  hessian_update_interval: int = setting(10, "sophia_h: steps between Hessian estimates (the "
                                         "paper's k)")
  sophia_gamma: float = setting(0.01, "sophia_h: the Hessian's scale in the update's "
                                "denominator (the paper's gamma)")
  muon_momentum: float = setting(0.95, "muon: the Nesterov momentum of the matrices' gradient "
                                 "average")
  muon_ns_steps: int = setting(5, "muon: Newton-Schulz iterations orthogonalizing each matrix's "
                               "update")
  muon_update_rms: float = setting(0.2, "muon: each orthogonalized update is scaled to this RMS; "
                                   "0.2 matches AdamW's (Moonlight), so learning_rate and "
                                   "weight_decay serve both groups")

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
        "sophia_gamma": checks.above(0),
        "decay_fraction": checks.unit(low_open=True),
        "muon_momentum": checks.unit(high_open=True),
        "muon_ns_steps": checks.at_least(1),
        "muon_update_rms": checks.above(0)})
    if self.decay_shape not in schedules.DECAY_SHAPES:
      raise UserError(f"config.optimizer.decay_shape must be one of "
                      f"{', '.join(schedules.DECAY_SHAPES)}; got {self.decay_shape!r}")


def learning_rate_schedule(cfg: OptimizerConfig, num_train_steps: int) -> optax.Schedule:
  return schedules.SCHEDULES[cfg.schedule].build(cfg, num_train_steps)


# A mixture's expert stacks ([experts, in, out]): matrices named as HF names them, not kernels.
EXPERT_STACKS = ("gate_proj", "up_proj", "down_proj")


def decay_mask(params):
  """Decay matrices (kernels, embeddings, a mixture's expert stacks), never biases, norm
  scales, LoRA's adapters of expert stacks or a router's balancing bias.

  Decided by name, not rank: stacked (scanned) layers make biases 2-D.
  """
  def decays(path, _) -> bool:
    names = [getattr(key, "key", None) for key in path]
    return names[-1] in ("kernel", "embedding") or (
        names[-1] in EXPERT_STACKS and len(names) > 1 and names[-2] == "experts")
  return jax.tree_util.tree_map_with_path(decays, params)


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


# Muon's groups, by each parameter's role (its path), not its shape: stacked (scanned) layers make
# biases and norm scales 2-D, and the embeddings and the head are matrices that Muon must not take.
ADAMW_LEAVES = ("embedding", "scale", "bias")  # Embeddings, norms' scales, biases.
ADAMW_MODULES = ("lm_head",)  # The head: a kernel, trained with the embeddings.
MUON_LEAVES = ("kernel", "lora_a", "lora_b")  # Dense projections (a MoE router's too), adapters.
MUON_MODULES = ("experts",)  # A mixture's stacked expert weights [experts, in, out].


def muon_group(path) -> str:
  """'muon' or 'adamw' for the parameter at `path` (a pytree key path); UserError for one of
  neither role."""
  name = path_name(path)
  parts = name.split("/")
  if parts[-1] in ADAMW_LEAVES or any(m in parts[:-1] for m in ADAMW_MODULES):
    return "adamw"
  if parts[-1] in MUON_LEAVES or any(m in parts[:-1] for m in MUON_MODULES):
    return "muon"
  raise UserError(f"optimizer muon: parameter {name} is neither a matrix for Muon (a kernel, an "
                  f"expert stack or a LoRA adapter) nor in the AdamW group (embeddings, lm_head, "
                  f"norm scales, biases)")


def muon_labels(params):
  return jax.tree_util.tree_map_with_path(lambda path, _: muon_group(path), params)


# Each Muon parameter's matrix is its last two axes, [in, out], as every family's Dense kernel and
# expert stack store it; the leading axes (a scan's layers, a mixture's experts) are batch axes,
# each matrix orthogonalized on its own.
LAST_TWO_AXES = optax.contrib.MuonDimensionNumbers(reduction_axis=-2, output_axis=-1)


def _matrix_axes(params):
  return jax.tree.map(lambda _: LAST_TWO_AXES, params)


def _muon(cfg: OptimizerConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
  # optax's own split (2-D or not) would hand Muon the embeddings and a scanned model's biases,
  # and its AdamW decays every parameter: the split here is by role, and the AdamW group is this
  # module's AdamW. Scaled to AdamW's update RMS, the matrices share its learning rate and decay.
  matrices = optax.contrib.muon(
      schedule, ns_steps=cfg.muon_ns_steps, beta=cfg.muon_momentum, nesterov=True,
      weight_decay=cfg.weight_decay, consistent_rms=cfg.muon_update_rms,
      muon_weight_dimension_numbers=_matrix_axes)
  return optax.partition({"muon": matrices, "adamw": _adamw(cfg, schedule)}, muon_labels)


@dataclasses.dataclass(frozen=True)
class Optimizer:
  build: Callable[[OptimizerConfig, optax.Schedule], optax.GradientTransformation]
  keys: tuple[str, ...]  # The OptimizerConfig fields it reads besides SHARED_KEYS.


# What every optimizer and schedule reads: the names, the peak and warmup, and the clipping.
SHARED_KEYS = ("name", "schedule", "learning_rate", "warmup_steps", "max_grad_norm")
OPTIMIZERS = {
    "adamw": Optimizer(_adamw, ("weight_decay", "beta1", "beta2", "epsilon")),
    "lion": Optimizer(_lion, ("weight_decay", "beta1", "beta2")),
    "adafactor": Optimizer(_adafactor, ("weight_decay",)),
    "sophia_h": Optimizer(_sophia_h, ("weight_decay", "beta1", "beta2", "epsilon", "sophia_gamma",
                                      "hessian_update_interval")),
    "muon": Optimizer(_muon, ("weight_decay", "beta1", "beta2", "epsilon", "muon_momentum",
                              "muon_ns_steps", "muon_update_rms")),
}


def ignored_keys(name: str, schedule: str) -> tuple[str, ...]:
  """The OptimizerConfig fields that neither the optimizer `name` nor the schedule reads."""
  read = SHARED_KEYS + OPTIMIZERS[name].keys + schedules.SCHEDULES[schedule].keys
  return tuple(f.name for f in dataclasses.fields(OptimizerConfig) if f.name not in read)


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
