"""A tiny byte-level Mistral (Llama with a sliding window of 64 of its 128 positions): a CPU run.

python -m levanter_flax.main --config=configs/mistral_nano.py
"""
from levanter_flax.config import default_config, model_config
from levanter_flax.models import mistral


def get_config():
  config = default_config()
  config.model = model_config(
      "mistral", vocab_size=384,  # The byte tokenizer's 257, padded to a multiple of 128.
      seq_len=128, num_layers=4, num_heads=4, num_kv_heads=2, hidden_dim=128,
      intermediate_dim=352, sliding_window=64)
  config.sharding.rules = mistral.PARTITION_RULES

  config.trainer.batch_size = 16
  config.trainer.num_train_steps = 300
  config.trainer.log_every_steps = 10
  config.trainer.eval_every_steps = 100
  config.trainer.eval_batches = 4
  config.trainer.checkpoint_every_steps = 100

  config.optimizer.learning_rate = 3e-3
  config.optimizer.warmup_steps = 20
  config.optimizer.weight_decay = 0.0
  return config
