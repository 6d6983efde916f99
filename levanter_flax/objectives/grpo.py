"""Group relative policy optimization (GRPO, Shao et al. 2024): the advantages of a group of
completions of one prompt, and the clipped policy loss on them, as TRL's GRPOTrainer computes
both.

Each prompt's `group_size` completions are scored (objectives/rewards.py). A completion's
advantage is its reward less its group's mean, divided by the group's standard deviation
(Bessel-corrected) + 1e-4; Dr. GRPO (Liu et al. 2025) leaves the division out
(scale_rewards "none"). Per completion token, with r = exp(log pi - log pi_old):

    loss = -min(r A, clip(r, 1 - epsilon_low, 1 + epsilon_high) A) + beta kl,
    kl = exp(ref - log pi) - (ref - log pi) - 1   (the k3 estimator, against the reference)

and the batch's loss aggregates the tokens as TRL's loss_type does:
  grpo: each completion's mean over its tokens, then the mean over completions;
  bnpo: the mean over every completion token of the batch;
  dr_grpo: the sum over completion tokens / (completions x max_completion_tokens).
May import core.
"""
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from levanter_flax.core import checks
from levanter_flax.core.errors import UserError
from levanter_flax.core.schema import FREE, setting
from levanter_flax.objectives import base

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo")
SCALINGS = ("group", "none")
_STD_FLOOR = 1e-4  # TRL's: a group whose rewards are all equal gets advantages of 0, not NaN.


@dataclasses.dataclass(frozen=True)
class GrpoConfig:
  """GRPO (config.rl): what it samples, how it scores and how it turns rewards into a loss
  (TRL's GRPOConfig names where they match). Each generation samples trainer.batch_size /
  group_size prompts' groups, and updates_per_batch steps train on it."""
  prompts: str = setting("", "GRPO: the JSON-lines prompts file, {\"prompt\" or \"messages\", "
                         "\"answer\", ...} a line", FREE)
  rewards: str = setting("exact_match", "GRPO: the rewards, summed: module:function[=weight], "
                         "comma-separated (built in: exact_match, math_answer)", FREE)
  group_size: int = setting(4, "GRPO: completions sampled per prompt, whose rewards are "
                            "compared (trainer.batch_size must be a multiple)", FREE)
  updates_per_batch: int = setting(1, "GRPO: optimizer steps on each generated batch (TRL's "
                                   "num_iterations); the ratio's old policy is the sampling one",
                                   FREE)
  temperature: float = setting(1.0, "GRPO: the sampling temperature; the policy's, the "
                               "sampler's and the reference's log-probs are of logits / this, as "
                               "TRL's", FREE)
  top_p: float = setting(1.0, "GRPO: nucleus sampling's probability mass; 1: all tokens", FREE)
  max_completion_tokens: int = setting(64, "GRPO: the most tokens a sampled completion has "
                                       "(dr_grpo divides its loss by it)", FREE)
  epsilon_low: float = setting(0.2, "GRPO: a token's probability ratio is clipped below at "
                               "1 - this (PPO's epsilon)", FREE)
  epsilon_high: float = setting(0.2, "GRPO: ... and above at 1 + this (DAPO's clip-higher "
                                "raises it alone)", FREE)
  beta: float = setting(0.0, "GRPO: the weight of the KL to the reference model (the k3 "
                        "estimator); 0: no KL, and no reference model is run", FREE)
  loss_type: str = setting("grpo", "GRPO: how token losses aggregate: grpo (per completion's "
                           "mean, then the mean), bnpo (the mean over the batch's tokens), "
                           "dr_grpo (the sum / (completions x max completion tokens))", FREE)
  scale_rewards: str = setting("group", "GRPO: group (advantages divided by the group's reward "
                               "std) or none (Dr. GRPO: not divided)", FREE)

  def __post_init__(self):
    checks.ranges(self, "rl", {
        "group_size": (lambda g: g >= 2, "at least 2: a completion's advantage compares it "
                       "with the others of its group"),
        "updates_per_batch": checks.above(0),
        "temperature": (lambda t: t > 0, "above 0: at 0 (greedy) a group's completions are "
                        "all alike, and so every advantage and gradient is 0"),
        "top_p": (lambda p: 0 < p <= 1, "in (0, 1]"),
        "max_completion_tokens": checks.above(0),
        "epsilon_low": (lambda e: 0 <= e < 1, "in [0, 1)"),
        "epsilon_high": checks.at_least(0),
        "beta": checks.at_least(0),
        "loss_type": (lambda t: t in LOSS_TYPES, f"one of {', '.join(LOSS_TYPES)}"),
        "scale_rewards": (lambda s: s in SCALINGS, f"one of {', '.join(SCALINGS)}")})


def parse_rewards(value: str) -> list[tuple[str, float]]:
  """config.rl.rewards as (name, weight) pairs: "exact_match,my.mod:fn=0.5"."""
  pairs = []
  for item in (part.strip() for part in value.split(",")):
    name, _, weight = item.partition("=")
    try:
      pairs.append((name.strip(), float(weight) if weight else 1.0))
    except ValueError:
      raise UserError(f"config.rl.rewards: {item!r} is not name=weight with a number") from None
    if not name.strip():
      raise UserError(f"config.rl.rewards {value!r}: name each reward, module:function[=weight]")
  return pairs


def group_advantages(rewards: np.ndarray, group_size: int, scale_rewards: str) -> np.ndarray:
  """Advantages [completions] of rewards [completions], each group_size consecutive ones a
  prompt's group."""
  if group_size < 2:  # One completion has nothing to be compared with (its std is NaN).
    raise UserError(f"rl.group_size must be at least 2: a completion's advantage compares it "
                    f"with the others of its group; got {group_size}")
  grouped = np.asarray(rewards, np.float64).reshape(-1, group_size)
  advantages = grouped - grouped.mean(axis=1, keepdims=True)
  if scale_rewards == "group":
    advantages = advantages / (grouped.std(axis=1, ddof=1, keepdims=True) + _STD_FLOOR)
  return advantages.reshape(-1).astype(np.float32)


def per_token_losses(log_probs: jax.Array, old_log_probs: jax.Array,
                     reference_log_probs: jax.Array | None, advantages: jax.Array,
                 cfg: GrpoConfig) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(loss per completion token [completions, tokens], per-token metrics of the same shape:
  kl, and the clip indicators TRL logs). log_probs: the policy's, of each completion token;
  old_log_probs: the sampling policy's (constants); reference_log_probs: the reference
  model's (needed when cfg.beta > 0); advantages [completions]."""
  advantages = advantages[:, None]
  ratio = jnp.exp(log_probs - old_log_probs)
  clipped = jnp.clip(ratio, 1 - cfg.epsilon_low, 1 + cfg.epsilon_high)
  losses = -jnp.minimum(ratio * advantages, clipped * advantages)
  low = (ratio < 1 - cfg.epsilon_low) & (advantages < 0)
  high = (ratio > 1 + cfg.epsilon_high) & (advantages > 0)
  metrics = {"clip_low": low, "clip_high": high, "clip_region": low | high}
  if cfg.beta:
    difference = reference_log_probs - log_probs
    kl = jnp.exp(difference) - difference - 1
    losses = losses + cfg.beta * kl
    metrics["kl"] = kl
  return losses, {name: value.astype(jnp.float32) for name, value in metrics.items()}


def aggregate(losses: jax.Array, mask: jax.Array, loss_type: str, max_completion_tokens: int,
              totals: dict[str, jax.Array] | None = None) -> jax.Array:
  """The batch's loss from token losses [completions, tokens] and the completion tokens' mask
  (cfg.loss_type's aggregation, as TRL's; a completion of no tokens counts one token).
  totals: the whole batch's (`batch_totals`) where these are a microbatch of it: the
  microbatches' losses then sum to the batch's."""
  mask = mask.astype(losses.dtype)
  masked = losses * mask
  totals = totals or batch_totals(mask)
  if loss_type == "grpo":
    return (masked.sum(axis=1) / jnp.maximum(mask.sum(axis=1), 1)).sum() / totals["rows"]
  if loss_type == "bnpo":
    return masked.sum() / totals["tokens"]
  if loss_type == "dr_grpo":
    return masked.sum() / (totals["rows"] * max_completion_tokens)
  raise ValueError(f"unknown loss_type {loss_type!r}")


def batch_totals(mask: jax.Array) -> dict[str, jax.Array]:
  """A batch's completions, and its completion tokens (at least 1), from their mask."""
  return {"rows": jnp.float32(mask.shape[0]),
          "tokens": jnp.maximum(mask.astype(jnp.float32).sum(), 1)}


def token_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
  """The mean of per-token values over the completion tokens (the metrics' reduction)."""
  mask = mask.astype(jnp.float32)
  return (values * mask).sum() / jnp.maximum(mask.sum(), 1)


@dataclasses.dataclass(frozen=True)
class Grpo(base.Objective):
  """GRPO on rollouts: each row a prompt and one sampled completion, whose targets weigh 1
  ("loss_weights"), with its advantage ("advantages") and the sampling policy's log-probability
  of each of tokens[:, 1:] ("old_log_probs"; outside the completion, not read)."""
  cfg: GrpoConfig = GrpoConfig()
  name = "grpo"
  reads = "rollouts"

  @classmethod
  def of_run(cls, run: Any, loss_weights: bool) -> "Grpo":
    return cls(run.rl)

  def batch_entries(self, seq_len: int) -> dict:
    return {"loss_weights": ((seq_len,), jnp.float32), "advantages": ((), jnp.float32),
            "old_log_probs": ((seq_len - 1,), jnp.float32)}

  @property
  def batch_multiple(self) -> int:
    return self.cfg.group_size

  @property
  def logit_temperature(self) -> float:
    return self.cfg.temperature

  @property
  def needs_reference(self) -> bool:
    return self.cfg.beta > 0

  def totals(self, batch: base.Batch) -> dict[str, jax.Array]:
    return batch_totals(batch["loss_weights"][:, 1:])

  def loss(self, token_losses, reference_token_losses, batch, totals):
    reference = None if reference_token_losses is None else -reference_token_losses
    mask = batch["loss_weights"][:, 1:]
    # Outside the completion the ratio is 1: a prompt's or padding's could overflow exp(), and
    # 0 x inf would make the masked loss's gradient NaN.
    old = jnp.where(mask > 0, batch["old_log_probs"], jax.lax.stop_gradient(-token_losses))
    losses, per_token = per_token_losses(-token_losses, old, reference, batch["advantages"],
                                         self.cfg)
    loss = aggregate(losses, mask, self.cfg.loss_type, self.cfg.max_completion_tokens, totals)
    return loss, {f"grpo/{name}": (value * mask).sum() / totals["tokens"]
                  for name, value in per_token.items()}
