"""OLMo 2 (Llama with norms after its sublayers and QK-norm over the whole projection):
--config=configs/olmo2.py:VARIANT, 1b when none is given.

nano: a tiny byte-level OLMo 2, llama.py:nano's run on the CPU:
    python -m levanter_flax.main --config=configs/olmo2.py:nano
1b: OLMo-2-0425-1B's shape (1.48B parameters: 16 layers, width 2048, 16 heads, SwiGLU 8192,
    an untied head, RoPE theta 500000), data parallel with ZeRO-3, to fine-tune from its
    checkpoint:
    python -m levanter_flax.main --config=configs/olmo2.py:1b \\
        --config.trainer.init_from_hf=/models/OLMo-2-0425-1B \\
        --config.data.dataset=/data/my_corpus \\
        --config.data.tokenizer=/models/OLMo-2-0425-1B/tokenizer.json
"""
from levanter_flax.config import (choose_variant, default_config, mesh, model_config, model_like,
                                  sibling_config)


def nano():
  config = sibling_config(__file__, "llama.py", "nano")
  config.model = model_like(config.model, "olmo2")
  return config


def olmo2_1b():
  config = default_config()
  config.model = model_config(
      "olmo2", vocab_size=100352, seq_len=4096, num_layers=16, num_heads=16, num_kv_heads=16,
      hidden_dim=2048, intermediate_dim=8192,
      compute=dict(dtype="bfloat16", remat="full", scan_layers=True,
                   cross_entropy_block_size=8192))
  config.trainer.device_mesh = mesh(data=-1, model=1)
  # ZeRO-3: its parameters and Adam state (12 bytes a parameter) are 18 GB whole.
  config.sharding.parameter_axis = "data"
  config.sharding.optimizer_axis = "data"

  config.trainer.batch_size = 16  # 64k tokens a step.
  config.trainer.num_train_steps = 2000
  config.optimizer.learning_rate = 2e-5  # Fine-tuning.
  config.optimizer.warmup_steps = 100
  return config


VARIANTS = {"nano": nano, "1b": olmo2_1b}


def get_config(variant=None):
  return choose_variant(__file__, variant, VARIANTS, default="1b")
