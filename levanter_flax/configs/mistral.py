"""Mistral (Llama with a sliding window):
--config=configs/mistral.py:VARIANT, 7b when none is given.

nano: a tiny byte-level Mistral, a sliding window of 64 of its 128 positions, llama.py:nano's
    run on the CPU:
    python -m levanter_flax.main --config=configs/mistral.py:nano
7b: Mistral 7B v0.1's shape (sliding window 4096 over 8192 positions) on a 2D mesh with ZeRO-3,
    to fine-tune from its checkpoint (--config.trainer.init_from_hf=/models/Mistral-7B-v0.1).

configs/mistral_<variant>.py name the same configs.
"""
from levanter_flax.config import (choose_variant, default_config, mesh, model_config, model_like,
                                  sibling_config)


def nano():
  config = sibling_config(__file__, "llama.py", "nano")
  config.model = model_like(config.model, "mistral", sliding_window=64)
  return config


def mistral_7b():
  config = default_config()
  config.model = model_config(
      "mistral", vocab_size=32000, seq_len=8192, num_layers=32, num_heads=32, num_kv_heads=8,
      hidden_dim=4096, intermediate_dim=14336, sliding_window=4096,
      compute=dict(dtype="bfloat16", remat="full", scan_layers=True,
                   cross_entropy_block_size=8192))
  config.trainer.device_mesh = mesh(data=-1, model=8)
  config.sharding.parameter_axis = "data"  # ZeRO-3.
  config.sharding.optimizer_axis = "data"

  config.trainer.batch_size = 64
  config.trainer.num_train_steps = 2000
  config.optimizer.learning_rate = 1e-5  # Fine-tuning.
  config.optimizer.warmup_steps = 100
  return config


VARIANTS = {"nano": nano, "7b": mistral_7b}


def get_config(variant=None):
  return choose_variant(__file__, variant, VARIANTS, default="7b")
