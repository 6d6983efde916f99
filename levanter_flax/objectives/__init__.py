"""Training objectives, one module each behind one interface (base.Objective): next-token
prediction (next_token), DPO on preference pairs (dpo), GRPO on sampled completions (grpo), and
the rewards GRPO scores completions with (rewards). The config chooses one by its name in
OBJECTIVES; training/step.py applies the model and hands each its token losses. May import
core."""
from typing import Any

from levanter_flax.objectives import base, dpo, grpo, next_token

OBJECTIVES: dict[str, type[base.Objective]] = {
    "next_token": next_token.NextToken,
    "dpo": dpo.Dpo,
    "grpo": grpo.Grpo,
}


def of_run(name: str, run: Any, loss_weights: bool = False) -> base.Objective:
  """The objective `name` as `run` (config.settings.RunConfig) sets it; loss_weights: the run's
  datasets carry them."""
  return OBJECTIVES[name].of_run(run, loss_weights)
