"""A tiny byte-level GPT-2: the CPU quickstart, a few minutes on 2 cores.

python -m levanter_flax.main --config=configs/gpt2_nano.py
"""
from levanter_flax.config import default_config


def get_config():
  config = default_config()
  config.model.vocab_size = 384  # The byte tokenizer's 257, padded to a multiple of 128.
  config.model.seq_len = 128
  config.model.num_layers = 4
  config.model.num_heads = 4
  config.model.hidden_dim = 128

  config.trainer.batch_size = 16
  config.trainer.num_train_steps = 300
  config.trainer.log_every_steps = 10
  config.trainer.eval_every_steps = 100
  config.trainer.eval_tokens = 131072
  config.checkpoint.every_steps = 100

  config.optimizer.learning_rate = 3e-3
  config.optimizer.warmup_steps = 20
  return config
