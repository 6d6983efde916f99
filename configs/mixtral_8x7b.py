"""Mixtral 8x7B's shape (8 experts of Mistral 7B's MLP, 2 per token: 47B parameters, 13B
active) with expert parallelism and ZeRO-3, to fine-tune from its checkpoint
(--config.trainer.init_from_hf=/models/Mixtral-8x7B-v0.1 --config.model.scan_layers=False:
HF checkpoints load into unrolled layers only).
"""
from levanter_flax.config import default_config, mesh, model_config


def get_config():
  config = default_config()
  config.model = model_config(
      "mixtral", vocab_size=32000, seq_len=4096, num_layers=32, num_heads=32, num_kv_heads=8,
      hidden_dim=4096, intermediate_dim=14336, num_experts=8, num_experts_per_token=2,
      dtype="bfloat16", remat="full", scan_layers=True, cross_entropy_block_size=8192)
  # Each device of an 8-wide expert group holds one expert, and the attention is split 8 ways
  # over the same devices: the batch goes over "data".
  config.trainer.device_mesh = mesh(data=-1, expert=8)
  config.sharding.tensor_axis = "expert"
  config.sharding.expert_axis = "expert"
  config.sharding.parameter_axis = "data"  # ZeRO-3.
  config.sharding.optimizer_axis = "data"

  config.trainer.batch_size = 64
  config.trainer.num_train_steps = 2000
  config.optimizer.learning_rate = 1e-5  # Fine-tuning.
  config.optimizer.warmup_steps = 100
  return config
