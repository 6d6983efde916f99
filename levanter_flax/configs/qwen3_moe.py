"""Qwen3-MoE (Qwen3 with a mixture of many narrow experts, 8 per token):
--config=configs/qwen3_moe.py:VARIANT, 30b_a3b when none is given.

nano: a tiny byte-level Qwen3-MoE, 16 experts of a width of 48 and 4 per token (as many active
    MLP columns as llama.py:nano's 352, near enough), qwen3.py:nano's run on the CPU:
    python -m levanter_flax.main --config=configs/qwen3_moe.py:nano
30b_a3b: Qwen3-30B-A3B's shape (48 layers, 128 experts of 768 and 8 per token: 30.5B
    parameters, 3.3B active) at 4096 tokens, one sequence a chip on v5p-64, the batch and
    ZeRO-3 over every device and the experts split 2 ways; to fine-tune from its checkpoint:
    python -m levanter_flax.main --config=configs/qwen3_moe.py:30b_a3b \\
        --config.trainer.init_from_hf=/models/Qwen3-30B-A3B \\
        --config.data.dataset=/data/my_corpus \\
        --config.data.tokenizer=/models/Qwen3-30B-A3B/tokenizer.json
"""
from levanter_flax.config import (choose_variant, default_config, expert_parallel, model_config,
                                  model_like, sibling_config)


def nano():
  config = sibling_config(__file__, "qwen3.py", "nano")
  config.model = model_like(config.model, "qwen3_moe", head_dim=64, tie_word_embeddings=True,
                            intermediate_dim=48,
                            moe=dict(num_experts=16, num_experts_per_token=4,
                                     router_aux_loss_coef=0.02))
  # One device splits nothing: --config.trainer.device_mesh.expert=4 on 8 devices gives each
  # 4 experts.
  expert_parallel(config, expert=1)
  return config


def qwen3_moe_30b_a3b():
  config = default_config()
  config.model = model_config(
      "qwen3_moe", vocab_size=151936, seq_len=4096, num_layers=48, num_heads=32, num_kv_heads=4,
      head_dim=128, hidden_dim=2048, intermediate_dim=768,
      moe=dict(num_experts=128, num_experts_per_token=8, normalize_top_k=True),
      compute=dict(dtype="bfloat16", remat="full", scan_layers=True,
                   cross_entropy_block_size=8192))
  expert_parallel(config, expert=2)

  config.trainer.batch_size = 32  # One sequence a chip on v5p-64: 128k tokens a step.
  config.trainer.num_train_steps = 2000
  config.optimizer.learning_rate = 1e-5  # Fine-tuning.
  config.optimizer.warmup_steps = 100
  return config


VARIANTS = {"nano": nano, "30b_a3b": qwen3_moe_30b_a3b}


def get_config(variant=None):
  return choose_variant(__file__, variant, VARIANTS, default="30b_a3b")
