"""Mixtral 8x7B's shape (8 experts of Mistral 7B's MLP, 2 per token: 47B parameters, 13B
active) with expert parallelism and ZeRO-3: mistral_7b's fine-tuning run with the family
swapped (--config.trainer.init_from_hf=/models/Mixtral-8x7B-v0.1).
"""
import pathlib

from levanter_flax.config import load_preset, mesh, model_config


def get_config():
  config = load_preset(pathlib.Path(__file__).parent / "mistral_7b.py")
  config.model = model_config(
      "mixtral", vocab_size=32000, seq_len=4096, num_layers=32, num_heads=32, num_kv_heads=8,
      hidden_dim=4096, intermediate_dim=14336, num_experts=8, num_experts_per_token=2,
      compute=dict(dtype="bfloat16", remat="full", scan_layers=True,
                   cross_entropy_block_size=8192))
  # Each device of an 8-wide expert group holds one expert, and the attention is split 8 ways
  # over the same devices: the batch goes over "data".
  config.trainer.device_mesh = mesh(data=-1, expert=8)
  config.sharding.tensor_axis = "expert"
  config.sharding.expert_axis = "expert"
  return config
