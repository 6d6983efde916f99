"""Sophia-H for GPT-2 medium/large-sized models, after the Sophia paper's settings.

A config pulls it in with
    config.optimizer.update(load_preset("optim/sophia_h_large"))
(a shipped preset's name, or a file's path),
or a run switches with --config.optimizer.name=sophia_h and the keys below.
"""
import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.name = "sophia_h"
  config.learning_rate = 4e-4  # Sophia's step is clipped to 1 per coordinate: lr bounds it.
  config.min_learning_rate_ratio = 0.05
  config.warmup_steps = 2000
  config.beta1 = 0.965
  config.beta2 = 0.99
  config.epsilon = 1e-12
  config.weight_decay = 0.2
  config.sophia_gamma = 0.01
  config.hessian_update_interval = 10
  config.max_grad_norm = 1.0
  return config
