"""nanoGPT's small CPU shape: the benchmark goals' reference point, not a model to ship.

Vocab 50304, 4 layers, 4 heads, width 256, context 256, batch 8, float32,
AdamW. `python bench/train_throughput.py --config=configs/nanogpt_cpu.py`.
"""
from levanter_flax.config import default_config


def get_config():
  config = default_config()
  config.model.vocab_size = 50304
  config.model.seq_len = 256
  config.model.num_layers = 4
  config.model.num_heads = 4
  config.model.hidden_dim = 256
  config.trainer.batch_size = 8
  config.data.document_masking = False  # nanoGPT attends across documents.
  return config
