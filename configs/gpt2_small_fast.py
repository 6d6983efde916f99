"""GPT-2 small with the fastest settings we know.

The vocabulary is padded from 50257 to 50304 (a multiple of 128) so the LM
head's matmuls tile evenly, and so the embedding splits over a `model` axis
of 2, 4 or 8; that adds 36,096 parameters (124,475,904 in all). Compute runs
in bfloat16 with float32 parameters, loss and optimizer state.
"""
from levanter_flax.config import default_config


def get_config():
  config = default_config()
  config.model.vocab_size = 50304
  config.model.compute.dtype = "bfloat16"
  config.trainer.batch_size = 32
  return config
