"""A tiny byte-level Qwen2 (Llama with q/k/v biases, tied embeddings): llama_nano's run.

python -m levanter_flax.main --config=configs/qwen2_nano.py
"""
import pathlib

from levanter_flax.config import load_preset, model_config


def get_config():
  config = load_preset(pathlib.Path(__file__).parent / "llama_nano.py")
  sizes = {k: config.model[k] for k in ("vocab_size", "seq_len", "num_layers", "num_heads",
                                        "num_kv_heads", "hidden_dim", "intermediate_dim")}
  # Tied, as Qwen2-0.5B and 1.5B.
  config.model = model_config("qwen2", tie_word_embeddings=True, **sizes)
  return config
