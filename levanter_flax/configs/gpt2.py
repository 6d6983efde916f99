"""GPT-2 at four sizes: --config=configs/gpt2.py:VARIANT, small when none is given.

nano: a tiny byte-level GPT-2, the CPU quickstart (a few minutes on 2 cores):
    python -m levanter_flax.main --config=configs/gpt2.py:nano
small: 124M parameters, 12 layers, 12 heads, width 768, context 1024. With vocab_size 50257
    and tied embeddings it has exactly GPT-2's 124,439,808 parameters. On the built-in corpus
    it trains on bytes (the byte tokenizer uses 257 of the 50257 ids), which keeps it runnable
    offline on any machine.
small_fast: small with the fastest settings we know, for one TPU v5e chip (16 GiB). The
    vocabulary is padded from 50257 to 50304 (a multiple of 128) so the LM head's matmuls tile
    evenly, and so the embedding splits over a `model` axis of 2, 4 or 8; that adds 36,096
    parameters (124,475,904 in all). Compute runs in bfloat16 with float32 parameters, loss and
    optimizer state; the batch of 128 runs as eight microbatches of 16, whose whole logits fit
    the chip (12.17 GiB planned), and splash attention takes the 1024 tokens as one block: 56.7%
    MFU there (docs/Performance-Guide.md).
medium: 355M parameters, 24 layers, 16 heads, width 1024, context 1024.

configs/gpt2_<variant>.py name the same configs.
"""
from levanter_flax.config import choose_variant, default_config


def nano():
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


def small():
  config = default_config()
  config.trainer.batch_size = 32
  config.trainer.num_train_steps = 10_000
  return config


def small_fast():
  config = small()
  config.model.vocab_size = 50304
  config.model.compute.dtype = "bfloat16"
  # Whole logits for 16 sequences rather than the loss a block of the vocabulary at a time for
  # more: the blocks' logits are computed again in the backward pass (50.6% MFU against 54.9%
  # at 32). Eight microbatches amortize the optimizer's update (56.7% against 54.9% for two).
  config.trainer.batch_size = 128
  config.trainer.gradient_accumulation_steps = 8
  config.model.compute.splash_block_q = 1024
  config.model.compute.splash_block_kv = 1024
  return config


def medium():
  config = small()
  config.model.num_layers = 24
  config.model.num_heads = 16
  config.model.hidden_dim = 1024
  config.optimizer.learning_rate = 3e-4
  return config


VARIANTS = {"nano": nano, "small": small, "medium": medium, "small_fast": small_fast}


def get_config(variant=None):
  return choose_variant(__file__, variant, VARIANTS, default="small")
