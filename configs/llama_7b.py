"""A 7B Llama (32 layers, width 4096, 32 heads, SwiGLU 11008, context 4096) on a 2D mesh.

ZeRO-3 over `data` shards parameters and optimizer state across the data
axis, and `model` splits each layer Megatron-style within a host (8 GPUs or
a TPU host). Multi-host: see launch/README.md.
"""
from levanter_flax.config import default_config, llama_model_config, mesh


def get_config():
  config = default_config()
  config.model = llama_model_config()
  config.model.num_layers = 32
  config.model.num_heads = 32
  config.model.num_kv_heads = 32
  config.model.hidden_dim = 4096
  config.model.intermediate_dim = 11008
  config.model.seq_len = 4096
  config.model.compute.dtype = "bfloat16"
  config.model.compute.scan_layers = True
  config.model.compute.remat = "full"
  config.model.compute.cross_entropy_block_size = 8192

  config.trainer.device_mesh = mesh(data=-1, model=8)
  config.sharding.parameter_axis = "data"  # ZeRO-3.
  config.sharding.optimizer_axis = "data"

  config.trainer.batch_size = 256  # 1M tokens at seq_len 4096.
  config.trainer.gradient_accumulation_steps = 8
  config.trainer.num_train_steps = 250_000
  config.optimizer.learning_rate = 3e-4
  config.optimizer.warmup_steps = 2000
  return config
