"""Qwen3-MoE: Qwen3 (per-head QK-norm, heads of their own width) with a mixture of experts in
place of every MLP.

The router (`mlp/gate`, no bias) takes each token to its num_experts_per_token best of
num_experts SwiGLU experts of intermediate_dim (HF's moe_intermediate_size), weighted by their
softmax probabilities, renormalised over those chosen when normalize_top_k (HF's
norm_topk_prob: Qwen3-30B-A3B's and 235B-A22B's are). The block is moe.MoeBlock; the attention
is Qwen3's. The Hugging Face layout is Qwen3MoeForCausalLM's. Dense layers among the sparse ones
(mlp_only_layers, decoder_sparse_step > 1) are refused: the released models have none.
"""
import dataclasses

from levanter_flax.core.schema import overridden
from levanter_flax.models import hf_keys, llama, moe, qwen3
from levanter_flax.models.family import HFLayout, ModelFamily
from levanter_flax.models.moe import MoeConfig, moe_section

PARTITION_RULES = moe.PARTITION_RULES + qwen3.PARTITION_RULES


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(qwen3.Qwen3Config):
  architecture: str = overridden(llama.LlamaConfig, "architecture", "qwen3_moe")
  moe: MoeConfig = moe_section(num_experts=128, num_experts_per_token=8)


class DecoderLayer(llama.DecoderLayer):
  feed_forward = moe.MoeBlock


class Qwen3MoeForCausalLM(llama.LlamaForCausalLM):
  decoder_layer = DecoderLayer


# Hugging Face's Qwen3MoeForCausalLM, as save_pretrained writes it (transformers 4 and 5): each
# expert's gate_proj, up_proj and down_proj Linear apart, under mlp.experts.<e>.


def config_from_hf(hf: dict) -> Qwen3MoeConfig:
  hf_keys.refuse_unless(hf, "Qwen3-MoE", {"decoder_sparse_step": 1, "mlp_only_layers": []})
  normalize = hf_keys.boolean(hf, "norm_topk_prob", False)
  fields = qwen3.qwen3_fields_from_hf(hf, "Qwen3-MoE")
  experts_width = {"intermediate_dim": hf_keys.integer(hf, "moe_intermediate_size")}
  return Qwen3MoeConfig(**fields | experts_width, moe=MoeConfig(
      # Qwen's config.json says num_experts; transformers 5 writes num_local_experts.
      num_experts=hf_keys.integer(hf, "num_experts", None) or hf_keys.integer(
          hf, "num_local_experts"),
      num_experts_per_token=hf_keys.integer(hf, "num_experts_per_tok"),
      normalize_top_k=normalize,
      router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001))))


def config_to_hf(cfg: Qwen3MoeConfig) -> dict:
  # intermediate_size is the dense MLP's width, which no layer has here: the experts' is written.
  return {**qwen3.config_to_hf(cfg), "architectures": ["Qwen3MoeForCausalLM"],
          "model_type": "qwen3_moe", "moe_intermediate_size": cfg.intermediate_dim,
          "decoder_sparse_step": 1, "mlp_only_layers": [],
          "num_experts": cfg.moe.num_experts,
          "num_experts_per_tok": cfg.moe.num_experts_per_token,
          "norm_topk_prob": cfg.moe.normalize_top_k,
          "router_aux_loss_coef": cfg.moe.router_aux_loss_coef}


def hf_tensor_names(cfg: Qwen3MoeConfig) -> dict:
  """Qwen3's names, with each MLP's three matrices as the stacks of their experts'."""
  return moe.hf_tensor_names(cfg, llama.hf_tensor_names(cfg), "mlp",
                             {name: name for name in moe.EXPERT_AXES})


FAMILY = ModelFamily(
    name="qwen3_moe", config=Qwen3MoeConfig, module=Qwen3MoeForCausalLM,
    partition_rules=PARTITION_RULES, layer_stack="layers", lookup_tables=llama.lookup_tables,
    hf=HFLayout("Qwen3MoeForCausalLM", config_from_hf, config_to_hf, hf_tensor_names),
    inactive_params=moe.inactive_params)
