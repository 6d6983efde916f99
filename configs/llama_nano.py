"""A tiny byte-level Llama (RoPE, RMSNorm, SwiGLU, grouped-query attention): a CPU run.

python -m levanter_flax.main --config=configs/llama_nano.py
"""
from levanter_flax.config import default_config, llama_model_config


def get_config():
  config = default_config()
  config.model = llama_model_config()
  config.model.vocab_size = 384  # The byte tokenizer's 257, padded to a multiple of 128.
  config.model.seq_len = 128
  config.model.num_layers = 4
  config.model.num_heads = 4
  config.model.num_kv_heads = 2
  config.model.hidden_dim = 128
  config.model.intermediate_dim = 352  # About 8/3 x hidden_dim, as Llama's SwiGLU.

  config.trainer.batch_size = 16
  config.trainer.num_train_steps = 300
  config.trainer.log_every_steps = 10
  config.trainer.eval_every_steps = 100
  config.trainer.eval_tokens = 131072
  config.checkpoint.every_steps = 100

  config.optimizer.learning_rate = 3e-3
  config.optimizer.warmup_steps = 20
  config.optimizer.weight_decay = 0.0
  return config
