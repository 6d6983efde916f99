"""The interface of a training objective: what its batch holds, its loss and metrics from the
model's token losses, whether it needs a reference model, and which data trains it.

training/step.py computes every token's cross-entropy (and the reference model's, where the
objective needs one) and hands them to the objective; the objective never applies a model.
Its loss is a sum over rows divided by what the whole batch holds (`totals`), so that the
microbatches of an accumulated step add up to the batch's loss exactly, whatever falls in
each. May import core.
"""
import abc
from typing import Any, ClassVar

import jax

Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]


class Objective(abc.ABC):
  """One way to train. A subclass is a frozen dataclass (of its config section, where it has
  one), registered by name in objectives/__init__.py."""
  name: ClassVar[str]  # Its registry key; checkpoints record it (a resume must not switch).
  # The data it trains on: "windows" (token windows, the next-token eval), "pairs"
  # (preference pairs, each one row; the pairs' eval), or "rollouts" (completions it samples).
  reads: ClassVar[str]

  @classmethod
  @abc.abstractmethod
  def of_run(cls, run: Any, loss_weights: bool) -> "Objective":
    """The objective as `run` (config.settings.RunConfig) sets it; loss_weights: the run's
    datasets carry them."""

  def batch_entries(self, seq_len: int) -> dict[str, tuple[tuple[int, ...], Any]]:
    """The batch's arrays besides "tokens" (int32[rows, seq_len]): name -> (shape after the
    rows, dtype)."""
    return {}

  @property
  def batch_multiple(self) -> int:
    """A batch's rows come in groups of this many (GRPO's completions of one prompt): the batch
    size, a searched one too, is a multiple of it."""
    return 1

  @property
  def logit_temperature(self) -> float:
    """What the logits are divided by before the token losses (the policy's, the reference's
    and a sampling policy's): an objective that trains on samples drawn at a temperature scores
    them at it, as TRL's GRPOTrainer does."""
    return 1.0

  @property
  def needs_reference(self) -> bool:
    """Whether the loss compares the policy with a reference model (the initial params, or
    LoRA's base), whose token losses `loss` then gets."""
    return False

  @abc.abstractmethod
  def totals(self, batch: Batch) -> Any:
    """What `loss` divides by, from the whole batch before it is cut into microbatches (e.g.
    its rows, or its weighted tokens)."""

  @abc.abstractmethod
  def loss(self, token_losses: jax.Array, reference_token_losses: jax.Array | None,
           batch: Batch, totals: Any) -> tuple[jax.Array, Metrics]:
    """(the loss, metrics named with the objective's prefix ("dpo/...")) of a batch or
    microbatch, both sums over its rows divided by `totals`. token_losses: float32
    [rows, seq_len - 1], the cross-entropy of each of tokens[:, 1:]."""

  def eval_rows(self, token_losses: jax.Array, reference_token_losses: jax.Array | None,
                batch: Batch) -> Any:
    """Per row of an eval batch, what the eval averages (data/eval_set.py: for "windows", each
    window's mean loss, or its (weighted sum, weight); for "pairs", each metric's value)."""
    raise NotImplementedError(f"the {self.name} objective has no eval set")
