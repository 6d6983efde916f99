"""A 1.1B Llama (TinyLlama's shape: 22 layers, width 2048, 32 query and 4 key/value heads).

Data parallel on one GPU node; bfloat16 compute, layers scanned, full remat.
Tokenized data: config.data.dataset and config.data.tokenizer, prepared with
python -m levanter_flax.prepare (a Llama tokenizer.json, vocab 32000).
"""
from levanter_flax.config import default_config, llama_model_config


def get_config():
  config = default_config()
  config.model = llama_model_config()
  config.model.compute.dtype = "bfloat16"
  config.model.compute.scan_layers = True
  config.model.compute.remat = "full"
  config.model.compute.cross_entropy_block_size = 8192

  config.trainer.batch_size = 256  # 0.5M tokens at seq_len 2048.
  config.trainer.gradient_accumulation_steps = 4
  config.trainer.num_train_steps = 100_000
  config.optimizer.learning_rate = 4e-4
  config.optimizer.warmup_steps = 2000
  return config
