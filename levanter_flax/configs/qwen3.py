"""Qwen3 (dense: Llama with per-head QK-norm and heads of their own width):
--config=configs/qwen3.py:VARIANT, 0_6b when none is given.

nano: a tiny byte-level Qwen3 with tied embeddings, 4 heads of 64 on a width of 128 (Qwen3's
    heads are wider than hidden_dim / num_heads), llama.py:nano's run on the CPU:
    python -m levanter_flax.main --config=configs/qwen3.py:nano
0_6b: Qwen3-0.6B's shape (596M parameters, 16 query and 8 key/value heads of 128 on a width of
    1024, tied embeddings), to fine-tune from its checkpoint:
    python -m levanter_flax.main --config=configs/qwen3.py:0_6b \\
        --config.trainer.init_from_hf=/models/Qwen3-0.6B \\
        --config.data.dataset=/data/my_corpus \\
        --config.data.tokenizer=/models/Qwen3-0.6B/tokenizer.json
"""
from levanter_flax.config import (choose_variant, default_config, mesh, model_config, model_like,
                                  sibling_config)


def nano():
  config = sibling_config(__file__, "llama.py", "nano")
  # Tied, as Qwen3-0.6B to 4B; heads twice hidden_dim / num_heads wide, as Qwen3-0.6B's.
  config.model = model_like(config.model, "qwen3", head_dim=64, tie_word_embeddings=True)
  return config


def qwen3_0_6b():
  config = default_config()
  config.model = model_config(
      "qwen3", vocab_size=151936, seq_len=4096, num_layers=28, num_heads=16, num_kv_heads=8,
      head_dim=128, hidden_dim=1024, intermediate_dim=3072, tie_word_embeddings=True,
      compute=dict(dtype="bfloat16", remat="full", scan_layers=True,
                   cross_entropy_block_size=8192))
  config.trainer.device_mesh = mesh(data=-1, model=1)

  config.trainer.batch_size = 16  # 64k tokens a step.
  config.trainer.num_train_steps = 2000
  config.optimizer.learning_rate = 2e-5  # Fine-tuning.
  config.optimizer.warmup_steps = 100
  return config


VARIANTS = {"nano": nano, "0_6b": qwen3_0_6b}


def get_config(variant=None):
  return choose_variant(__file__, variant, VARIANTS, default="0_6b")
