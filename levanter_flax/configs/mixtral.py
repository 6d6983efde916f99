"""Mixtral (Mistral with a mixture of experts, 8 experts, 2 per token):
--config=configs/mixtral.py:VARIANT, 8x7b when none is given.

nano: a tiny byte-level Mixtral, each expert a quarter of llama.py:nano's MLP: llama.py:nano's
    run, with expert parallelism when there are devices for it:
    python -m levanter_flax.main --config=configs/mixtral.py:nano
8x7b: Mixtral 8x7B's shape (8 experts of Mistral 7B's MLP: 47B parameters, 13B active) at
    4096 tokens, one sequence a chip on v5p-128: the batch over every device, each pair of
    devices splitting the experts (4 each, tokens sent to them by all-to-all) and ZeRO-3 over
    all of them: mistral.py:7b's fine-tuning run with the family swapped
    (--config.trainer.init_from_hf=/models/Mixtral-8x7B-v0.1).

configs/mixtral_<variant>.py name the same configs.
"""
from levanter_flax.config import (choose_variant, expert_parallel, mesh, model_like,
                                  sibling_config)


def nano():
  config = sibling_config(__file__, "llama.py", "nano")
  config.model = model_like(config.model, "mixtral", intermediate_dim=96,
                            moe=dict(num_experts=8, num_experts_per_token=2,
                                     router_aux_loss_coef=0.02))
  # The experts are split over "expert" (1 on one device: --config.trainer.device_mesh.expert=4
  # on 8 devices gives 2 per device).
  config.trainer.device_mesh = mesh(data=-1, expert=1)
  config.sharding.tensor_axis = ""
  config.sharding.expert_axis = "expert"
  return config


def mixtral_8x7b():
  config = sibling_config(__file__, "mistral.py", "7b")
  config.model = model_like(config.model, "mixtral", seq_len=4096,
                            moe=dict(num_experts=8, num_experts_per_token=2))
  # Expert parallelism 2 ways: the experts' gathers (ZeRO-3) halve, while each device's
  # dropless inbox holds 2x its tokens' copies; 4 or 8 ways need more memory (Performance Guide).
  expert_parallel(config, expert=2)
  return config


VARIANTS = {"nano": nano, "8x7b": mixtral_8x7b}


def get_config(variant=None):
  return choose_variant(__file__, variant, VARIANTS, default="8x7b")
