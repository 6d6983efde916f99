"""Direct preference optimization (DPO, Rafailov et al. 2023) on preference data.

A run whose datasets are preference data (prepare --source=preference) trains by DPO: each
window of its batches is one pair, prompt + chosen reply and prompt + rejected reply in one
row (data/preference.py), and its loss weights are codes, CHOSEN on the chosen reply's target
tokens and REJECTED on the rejected's. A reply's log-probability is the sum over its targets;
the reference model's (step.py: the frozen initial weights, or LoRA's base without its
adapters) are constants. With Δ = (π_c - ref_c) - (π_r - ref_r), a pair's loss is

    -(1 - ls) log σ(β Δ) - ls log σ(-β Δ)

the "robust" (cDPO) label smoothing of a preference that is wrong with probability ls; ls = 0
is DPO's. The batch's loss is the mean over its pairs, so equal-sized microbatches average to
it exactly.
"""
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from levanter_flax.core import checks
from levanter_flax.core.schema import FREE, setting
from levanter_flax.objectives import base

CHOSEN, REJECTED = 1, 2  # The loss weight codes of a preference row's targets.


@dataclasses.dataclass(frozen=True)
class DpoConfig:
  """DPO's loss, for runs on preference data (config.dpo)."""
  beta: float = setting(0.1, "DPO: how far the policy may move from the reference model; the "
                        "rewards are beta * (log pi - log ref)", FREE)
  label_smoothing: float = setting(
      0.0, "DPO: the chance that a pair's preference is wrong (cDPO's robust loss); 0: plain "
      "DPO", FREE)

  def __post_init__(self):
    # At 0.5 a pair's loss no longer depends on which reply is preferred.
    checks.ranges(self, "dpo", {"beta": checks.above(0),
                                "label_smoothing": (lambda ls: 0 <= ls < 0.5, "in [0, 0.5)")})


def reply_log_probs(token_losses: jax.Array, codes: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(chosen, rejected) log-probabilities per row, float32[rows] each: token_losses are the
  cross-entropies of tokens[:, 1:], codes the loss weight codes of tokens (those of [:, 0] are
  never a target)."""
  targets = codes[:, 1:]
  log_probs = -token_losses
  return (jnp.where(targets == CHOSEN, log_probs, 0).sum(axis=1),
          jnp.where(targets == REJECTED, log_probs, 0).sum(axis=1))


def pair_metrics(policy: tuple[jax.Array, jax.Array], reference: tuple[jax.Array, jax.Array],
                 cfg: DpoConfig) -> dict[str, jax.Array]:
  """Per pair (float32[rows] each): "loss" and the dpo/ metrics, the rewards being
  beta * (log pi - log ref) of each reply."""
  chosen_reward = cfg.beta * (policy[0] - reference[0])
  rejected_reward = cfg.beta * (policy[1] - reference[1])
  margin = chosen_reward - rejected_reward  # beta * Δ.
  smoothing = cfg.label_smoothing
  loss = -(1 - smoothing) * jax.nn.log_sigmoid(margin) - smoothing * jax.nn.log_sigmoid(-margin)
  return {"loss": loss,
          "dpo/reward_accuracy": (chosen_reward > rejected_reward).astype(jnp.float32),
          "dpo/margin": margin,
          "dpo/chosen_reward": chosen_reward,
          "dpo/rejected_reward": rejected_reward}


@dataclasses.dataclass(frozen=True)
class Dpo(base.Objective):
  """DPO on preference rows, whose "loss_weights" are the codes, against the reference model."""
  cfg: DpoConfig = DpoConfig()
  name = "dpo"
  reads = "pairs"

  @classmethod
  def of_run(cls, run: Any, loss_weights: bool) -> "Dpo":
    return cls(run.dpo)

  def batch_entries(self, seq_len: int) -> dict:
    return {"loss_weights": ((seq_len,), jnp.float32)}

  @property
  def needs_reference(self) -> bool:
    return True

  def totals(self, batch: base.Batch) -> jax.Array:
    return jnp.float32(batch["tokens"].shape[0])  # The pairs: the loss is their mean.

  def loss(self, token_losses, reference_token_losses, batch, totals):
    pairs = self.eval_rows(token_losses, reference_token_losses, batch)
    sums = {name: value.sum() / totals for name, value in pairs.items()}
    return sums.pop("loss"), sums

  def eval_rows(self, token_losses, reference_token_losses, batch):
    codes = batch["loss_weights"]
    return pair_metrics(reply_log_probs(token_losses, codes),
                        reply_log_probs(reference_token_losses, codes), self.cfg)
