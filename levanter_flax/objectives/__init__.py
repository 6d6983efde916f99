"""Training objectives beyond next-token prediction, as pure functions of a batch's
log-probabilities: DPO on preference pairs (dpo), GRPO's advantages and clipped loss (grpo), and
the rewards GRPO scores completions with (rewards). May import core."""
