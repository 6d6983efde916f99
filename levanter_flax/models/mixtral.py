"""Mixtral: Mistral with a sparse mixture of experts in place of each MLP.

A router (`mlp/gate`, no bias) scores num_experts SwiGLU experts per token; the token goes to
its num_experts_per_token best, weighted by their softmax probabilities renormalised over those
chosen (as transformers' Mixtral). The block is moe.MoeBlock: see moe.py for the dispatch, the
grouped matmul and the router's losses and metrics.
"""
import dataclasses

from levanter_flax.core.errors import UserError
from levanter_flax.core.schema import overridden
from levanter_flax.models import hf_keys, llama, mistral, moe
from levanter_flax.models.family import HFLayout, ModelFamily
from levanter_flax.models.moe import MoeConfig, moe_section

PARTITION_RULES = moe.PARTITION_RULES + llama.PARTITION_RULES


@dataclasses.dataclass(frozen=True)
class MixtralConfig(mistral.MistralConfig):
  architecture: str = overridden(llama.LlamaConfig, "architecture", "mixtral")
  sliding_window: int = overridden(llama.LlamaConfig, "sliding_window", 0)  # 8x7B, 8x22B: none.
  rope_theta: float = overridden(llama.LlamaConfig, "rope_theta", 1_000_000.0)
  moe: MoeConfig = moe_section()

  def __post_init__(self):
    super().__post_init__()
    if not self.moe.normalize_top_k:
      raise UserError("config.model.moe.normalize_top_k must be True for mixtral: transformers' "
                      "Mixtral always renormalises the chosen experts' weights")


class DecoderLayer(llama.DecoderLayer):
  feed_forward = moe.MoeBlock


class MixtralForCausalLM(llama.LlamaForCausalLM):
  decoder_layer = DecoderLayer


# Hugging Face's MixtralForCausalLM, as save_pretrained writes it (transformers 4 and 5): each
# expert's w1 (gate), w3 (up) and w2 (down) Linear apart, under block_sparse_moe.


def config_from_hf(hf: dict) -> MixtralConfig:
  hf_keys.refuse_unless(hf, "Mixtral", {"hidden_act": "silu", "router_jitter_noise": 0.0,
                                        "tie_word_embeddings": False})
  return MixtralConfig(**llama.llama_fields_from_hf(hf),
                       sliding_window=hf_keys.integer(hf, "sliding_window", 0),
                       moe=MoeConfig(
                           num_experts=hf_keys.integer(hf, "num_local_experts"),
                           num_experts_per_token=hf_keys.integer(hf, "num_experts_per_tok"),
                           router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001))))


def config_to_hf(cfg: MixtralConfig) -> dict:
  return {**llama.llama_fields_to_hf(cfg), "architectures": ["MixtralForCausalLM"],
          "model_type": "mixtral", "sliding_window": cfg.sliding_window or None,
          "num_local_experts": cfg.moe.num_experts,
          "num_experts_per_tok": cfg.moe.num_experts_per_token,
          "router_aux_loss_coef": cfg.moe.router_aux_loss_coef, "router_jitter_noise": 0.0}


def hf_tensor_names(cfg: MixtralConfig) -> dict:
  """Llama's names, with each MLP's three matrices as the stacks of their experts'."""
  return moe.hf_tensor_names(cfg, llama.hf_tensor_names(cfg), "block_sparse_moe",
                             {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"})


FAMILY = ModelFamily(
    name="mixtral", config=MixtralConfig, module=MixtralForCausalLM,
    partition_rules=PARTITION_RULES, layer_stack="layers", lookup_tables=llama.lookup_tables,
    hf=HFLayout("MixtralForCausalLM", config_from_hf, config_to_hf, hf_tensor_names),
    inactive_params=moe.inactive_params)
