"""A tiny byte-level Mistral (Llama with a sliding window of 64 of its 128 positions):
llama_nano's run.

python -m levanter_flax.main --config=configs/mistral_nano.py
"""
import pathlib

from levanter_flax.config import load_preset, model_config


def get_config():
  config = load_preset(pathlib.Path(__file__).parent / "llama_nano.py")
  sizes = {k: config.model[k] for k in ("vocab_size", "seq_len", "num_layers", "num_heads",
                                        "num_kv_heads", "hidden_dim", "intermediate_dim")}
  config.model = model_config("mistral", sliding_window=64, **sizes)
  return config
