"""Evaluation of a trained model: lm-eval-harness's LM interface on our params (harness), and
lm-eval tasks run on a run or an HF checkpoint (tasks). May import generate and below."""
