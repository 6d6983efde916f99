"""Evaluation of a trained model: lm-eval-harness's LM interface on our params (harness).
May import generate and below."""
