"""GPT-2 medium: 355M parameters, 24 layers, 16 heads, width 1024, context 1024."""
from levanter_flax.config import default_config


def get_config():
  config = default_config()
  config.model.num_layers = 24
  config.model.num_heads = 16
  config.model.hidden_dim = 1024
  config.optimizer.learning_rate = 3e-4
  return config
