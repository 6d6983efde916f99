"""Qwen2 (Llama with q/k/v biases):
--config=configs/qwen2.py:VARIANT, 0_5b when none is given.

nano: a tiny byte-level Qwen2 with tied embeddings, llama.py:nano's run on the CPU:
    python -m levanter_flax.main --config=configs/qwen2.py:nano
0_5b: Qwen2-0.5B's shape (494M parameters, tied embeddings), to fine-tune from its checkpoint:
    python -m levanter_flax.main --config=configs/qwen2.py:0_5b \\
        --config.trainer.init_from_hf=/models/Qwen2-0.5B \\
        --config.data.dataset=/data/my_corpus \\
        --config.data.tokenizer=/models/Qwen2-0.5B/tokenizer.json

0_5b_sft: chat SFT from Qwen2-0.5B-Instruct, as README.md's "Fine-tune a Hugging Face model"
    runs it (prepare --source=chat, then this with the same three keys as 0_5b).

0_5b_dpo: DPO of such a chat model on preference pairs (prepare --source=preference
    --seq_len=1024), the same three keys.

configs/qwen2_<variant>.py name 0_5b and nano too.
"""
from levanter_flax.config import (choose_variant, default_config, mesh, model_config, model_like,
                                  sibling_config)


def nano():
  config = sibling_config(__file__, "llama.py", "nano")
  # Tied, as Qwen2-0.5B and 1.5B.
  config.model = model_like(config.model, "qwen2", tie_word_embeddings=True)
  return config


def qwen2_0_5b():
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


def qwen2_0_5b_sft():
  """Supervised fine-tuning of Qwen2-0.5B(-Instruct) on chat data (prepare --source=chat): the
  loss on the assistant's turns alone, conversations packed with document masking."""
  config = qwen2_0_5b()
  config.trainer.batch_size = 16  # 32k tokens a step at seq_len 2048.
  config.trainer.num_train_steps = 1000
  config.optimizer.learning_rate = 1e-5
  config.optimizer.warmup_steps = 30
  config.checkpoint.every_steps = 200
  return config


def qwen2_0_5b_dpo():
  """DPO of a Qwen2-0.5B chat model (0_5b_sft's export, or Qwen2-0.5B-Instruct) on preference
  pairs prepared with --source=preference --seq_len=1024; the reference model is the starting
  checkpoint, kept once in the workdir."""
  config = qwen2_0_5b()
  config.model.seq_len = 1024  # One pair, prompt and both replies, per row.
  config.trainer.batch_size = 32  # Pairs a step.
  config.trainer.num_train_steps = 500
  config.optimizer.learning_rate = 5e-7  # DPO moves a model little (Rafailov et al. used 1e-6).
  config.optimizer.warmup_steps = 50
  config.optimizer.weight_decay = 0.0
  config.dpo.beta = 0.1
  config.checkpoint.every_steps = 100
  return config


VARIANTS = {"nano": nano, "0_5b": qwen2_0_5b, "0_5b_sft": qwen2_0_5b_sft,
            "0_5b_dpo": qwen2_0_5b_dpo}


def get_config(variant=None):
  return choose_variant(__file__, variant, VARIANTS, default="0_5b")
