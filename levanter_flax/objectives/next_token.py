"""Next-token prediction: the mean cross-entropy of each token given those before it, or,
with loss weights (chat and instruction data, which weigh the assistant's tokens only), the
weighted mean. May import core."""
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from levanter_flax.objectives import base


@dataclasses.dataclass(frozen=True)
class NextToken(base.Objective):
  """weighted: batches carry "loss_weights" (float32, tokens' shape: each token's weight as a
  target, so that of tokens[:, 0] is never read)."""
  weighted: bool = False
  name = "next_token"
  reads = "windows"

  @classmethod
  def of_run(cls, run: Any, loss_weights: bool) -> "NextToken":
    return cls(weighted=loss_weights)

  def batch_entries(self, seq_len: int) -> dict:
    return {"loss_weights": ((seq_len,), jnp.float32)} if self.weighted else {}

  def totals(self, batch: base.Batch) -> jax.Array:
    """The batch's weight as targets (1 if none weighs: its weighted mean is then 0), or its
    count of targets."""
    if not self.weighted:
      rows, length = batch["tokens"].shape
      return jnp.float32(rows * (length - 1))
    total = batch["loss_weights"][:, 1:].sum()
    return jnp.where(total > 0, total, 1.0)

  def loss(self, token_losses, reference_token_losses, batch, totals):
    if self.weighted:
      token_losses = token_losses * batch["loss_weights"][:, 1:]
    return token_losses.sum() / totals, {}

  def eval_rows(self, token_losses, reference_token_losses, batch):
    """Each window's mean loss, float32[rows]; a batch with loss weights: (each window's weighted
    sum, its weight), since its windows weigh differently."""
    if "loss_weights" not in batch:
      return token_losses.mean(axis=1)
    weights = batch["loss_weights"][:, 1:]
    return (token_losses * weights).sum(axis=1), weights.sum(axis=1)
