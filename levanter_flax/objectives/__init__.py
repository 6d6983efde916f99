"""Training objectives beyond next-token prediction, as pure loss functions of a batch's
log-probabilities: DPO on preference pairs (dpo). May import core."""
