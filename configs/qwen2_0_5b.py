"""Qwen2-0.5B's shape (494M parameters, tied embeddings), to fine-tune from its checkpoint:

python -m levanter_flax.main --config=configs/qwen2_0_5b.py \
    --config.trainer.init_from_hf=/models/Qwen2-0.5B \
    --config.data.dataset=/data/my_corpus --config.data.tokenizer=/models/Qwen2-0.5B/tokenizer.json
"""
from levanter_flax.config import default_config, mesh, model_config


def get_config():
  config = default_config()
  config.model = model_config(
      "qwen2", vocab_size=151936, seq_len=2048, num_layers=24, num_heads=14, num_kv_heads=2,
      hidden_dim=896, intermediate_dim=4864, tie_word_embeddings=True, 
      compute=dict(dtype="bfloat16", remat="full", scan_layers=True,
                   cross_entropy_block_size=8192))
  config.trainer.device_mesh = mesh(data=-1, model=1)

  config.trainer.batch_size = 32
  config.trainer.num_train_steps = 2000
  config.optimizer.learning_rate = 2e-5  # Fine-tuning.
  config.optimizer.warmup_steps = 100
  return config
