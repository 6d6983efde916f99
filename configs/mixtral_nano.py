"""A tiny byte-level Mixtral (8 experts, 2 per token, each a quarter of llama_nano's MLP):
llama_nano's run, with expert parallelism when there are devices for it.

python -m levanter_flax.main --config=configs/mixtral_nano.py
"""
import pathlib

from levanter_flax.config import load_preset, mesh, model_config


def get_config():
  config = load_preset(pathlib.Path(__file__).parent / "llama_nano.py")
  sizes = {k: config.model[k] for k in ("vocab_size", "seq_len", "num_layers", "num_heads",
                                        "num_kv_heads", "hidden_dim")}
  config.model = model_config("mixtral", intermediate_dim=96, num_experts=8,
                              num_experts_per_token=2, router_aux_loss_coef=0.02, **sizes)
  # The experts are split over "expert" (1 on one device: --config.trainer.device_mesh.expert=4
  # on 8 devices gives 2 per device).
  config.trainer.device_mesh = mesh(data=-1, expert=1)
  config.sharding.tensor_axis = ""
  config.sharding.expert_axis = "expert"
  return config
