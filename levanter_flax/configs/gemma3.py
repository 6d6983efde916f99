"""Gemma 3 (text: local sliding-window and global layers, QK-norm, pre- and post-norms, GeGLU):
--config=configs/gemma3.py:VARIANT, 1b when none is given.

nano: a tiny byte-level Gemma 3 with tied embeddings, 4 layers alternating local (a window of
    32 of the 128 tokens) and global, heads of 64 on a width of 128, llama.py:nano's run on the
    CPU:
    python -m levanter_flax.main --config=configs/gemma3.py:nano
1b: Gemma 3 1B's shape (1.0B parameters, 26 layers, 5 local : 1 global, window 512, 4 query
    heads and 1 key/value head of 256 on a width of 1152, vocabulary 262144, tied embeddings),
    to fine-tune from its checkpoint:
    python -m levanter_flax.main --config=configs/gemma3.py:1b \\
        --config.trainer.init_from_hf=/models/gemma-3-1b-pt \\
        --config.data.dataset=/data/my_corpus \\
        --config.data.tokenizer=/models/gemma-3-1b-pt/tokenizer.json
"""
from levanter_flax.config import (choose_variant, default_config, mesh, model_config, model_like,
                                  sibling_config)


def nano():
  config = sibling_config(__file__, "llama.py", "nano")
  # Local and global layers alternate, the window a quarter of the sequence: both kinds matter.
  config.model = model_like(config.model, "gemma3", head_dim=64, query_pre_attn_scalar=64,
                            sliding_window=32, sliding_window_pattern=2)
  return config


def gemma3_1b():
  config = default_config()
  config.model = model_config(
      "gemma3", vocab_size=262144, seq_len=4096, num_layers=26, num_heads=4, num_kv_heads=1,
      head_dim=256, hidden_dim=1152, intermediate_dim=6912, sliding_window=512,
      sliding_window_pattern=6, rope_theta=1_000_000.0, rope_local_theta=10_000.0,
      query_pre_attn_scalar=256, tie_word_embeddings=True,
      compute=dict(dtype="bfloat16", remat="full", scan_layers=True,
                   cross_entropy_block_size=8192))
  config.trainer.device_mesh = mesh(data=-1, model=1)  # One key/value head: no tensor split.

  config.trainer.batch_size = 16  # 64k tokens a step.
  config.trainer.num_train_steps = 2000
  config.optimizer.learning_rate = 2e-5  # Fine-tuning.
  config.optimizer.warmup_steps = 100
  return config


VARIANTS = {"nano": nano, "1b": gemma3_1b}


def get_config(variant=None):
  return choose_variant(__file__, variant, VARIANTS, default="1b")
