"""DeepSeek-V3 (multi-head latent attention; 256 experts of which 8 per token, chosen by sigmoid
scores within 4 of 8 groups and balanced by a bias, beside a shared expert):
--config=configs/deepseek_v3.py:VARIANT, 671b when none is given.

nano: a tiny byte-level DeepSeek-V3 on the CPU: one dense layer, then three of 16 experts of a
    width of 48 in 4 groups (4 per token, from 2 groups) and a shared one, the latent 32 wide:
    python -m levanter_flax.main --config=configs/deepseek_v3.py:nano
671b: DeepSeek-V3's shape (61 layers, the first 3 dense, 671B parameters, 37B active) at 4096
    tokens, for planning (levanter-flax aot): the batch and ZeRO-3 over every device,
    the experts split 8 ways. Its checkpoint has a multi-token-prediction layer, which is
    refused: this config trains from scratch.
"""
from levanter_flax.config import (choose_variant, default_config, expert_parallel, model_config,
                                  model_like, sibling_config)


def nano():
  config = sibling_config(__file__, "llama.py", "nano")
  config.model = model_like(
      config.model, "deepseek_v3", num_kv_heads=config.model.num_heads, q_lora_rank=64,
      kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
      first_dense_layers=1,
      moe=dict(num_experts=16, num_experts_per_token=4, num_groups=4, top_groups=2,
               expert_dim=48, num_shared_experts=1, routed_scaling_factor=1.0,
               router_aux_loss_coef=0.0001))
  # One device splits nothing: --config.trainer.device_mesh.expert=4 on 8 devices gives each
  # 4 experts.
  expert_parallel(config, expert=1)
  return config


def deepseek_v3_671b():
  config = default_config()
  config.model = model_config(
      "deepseek_v3", vocab_size=129280, seq_len=4096, num_layers=61, num_heads=128,
      num_kv_heads=128, hidden_dim=7168, intermediate_dim=18432, q_lora_rank=1536,
      kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
      first_dense_layers=3,
      moe=dict(num_experts=256, num_experts_per_token=8, num_groups=8, top_groups=4,
               expert_dim=2048, num_shared_experts=1, routed_scaling_factor=2.5),
      compute=dict(dtype="bfloat16", remat="full", scan_layers=True,
                   cross_entropy_block_size=8192))
  expert_parallel(config, expert=8)

  config.trainer.batch_size = 256  # One sequence a chip on v5p-512: 1M tokens a step.
  config.trainer.num_train_steps = 100_000
  config.optimizer.learning_rate = 2.2e-4  # DeepSeek-V3's peak.
  config.optimizer.warmup_steps = 2000
  return config


VARIANTS = {"nano": nano, "671b": deepseek_v3_671b}


def get_config(variant=None):
  return choose_variant(__file__, variant, VARIANTS, default="671b")
