"""GPT-2 small: 124M parameters, 12 layers, 12 heads, width 768, context 1024.

With vocab_size 50257 and tied embeddings it has exactly GPT-2's 124,439,808
parameters. On the built-in corpus it trains on bytes (the byte tokenizer uses
257 of the 50257 ids), which keeps it runnable offline on any machine.
"""
from levanter_flax.config import default_config


def get_config():
  config = default_config()
  config.trainer.batch_size = 32
  config.trainer.num_train_steps = 10_000
  return config
