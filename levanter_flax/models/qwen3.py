"""Qwen3 (dense): Llama with RMSNorm on each query and key head, and heads of their own width.

Each head's query and key are RMS-normalised over head_dim (one scale of head_dim shared by the
heads, self_attn/q_norm and k_norm) before RoPE; there are no q/k/v biases (Qwen2's are gone),
and head_dim is a setting, not hidden_dim / num_heads (Qwen3-0.6B: 16 heads of 128 on a width
of 1024). Its other conventions are config values: RoPE theta 1e6, RMSNorm epsilon 1e-6, and
in the small models (0.6B to 4B) the token embedding as the LM head. The module is Llama's
(models/llama.py) with qk_norm "head"; the Hugging Face layout is Qwen3ForCausalLM's. Qwen3's
sliding window is refused: the released models do not use it.
"""
import dataclasses

from levanter_flax.core.errors import UserError
from levanter_flax.models import hf_keys, llama
from levanter_flax.models.family import HFLayout, ModelFamily
from levanter_flax.core.schema import overridden

PARTITION_RULES = llama.PER_HEAD_NORM_RULES + llama.PARTITION_RULES
# transformers' Qwen3Config.head_dim when config.json has none (not hidden_size / heads).
HF_HEAD_DIM = 128


@dataclasses.dataclass(frozen=True)
class Qwen3Config(llama.LlamaConfig):
  architecture: str = overridden(llama.LlamaConfig, "architecture", "qwen3")
  rope_theta: float = overridden(llama.LlamaConfig, "rope_theta", 1_000_000.0)
  rms_norm_epsilon: float = overridden(llama.LlamaConfig, "rms_norm_epsilon", 1e-6)
  head_dim: int = llama.head_dim_setting("Qwen3's is 128 at every size")
  qk_norm = "head"

  def __post_init__(self):
    super().__post_init__()
    if self.qkv_bias:
      raise UserError("config.model.qkv_bias: Qwen3 has no query, key or value biases (Qwen2 "
                      "has: architecture='qwen2')")
    llama.resolve_head_dim(self)


def config_from_hf(hf: dict) -> Qwen3Config:
  return Qwen3Config(**qwen3_fields_from_hf(hf, "Qwen3"))


def qwen3_fields_from_hf(hf: dict, family: str) -> dict:
  """Qwen3Config's fields from a config.json of the Qwen3 kind (Qwen3, Qwen3-MoE)."""
  hf_keys.refuse_unless(hf, family, {"use_sliding_window": False, "hidden_act": "silu",
                                     "attention_bias": False})
  layer_types = hf.get("layer_types") or []
  if not isinstance(layer_types, list) or any(t != "full_attention" for t in layer_types):
    raise UserError(f"{family} config layer_types={layer_types!r} is not supported (only "
                    f"full_attention layers)")
  return llama.llama_fields_from_hf(hf, head_dim=HF_HEAD_DIM)


def config_to_hf(cfg: Qwen3Config) -> dict:
  return {**llama.llama_fields_to_hf(cfg), "architectures": ["Qwen3ForCausalLM"],
          "model_type": "qwen3", "head_dim": cfg.head_dim, "attention_bias": False,
          "use_sliding_window": False, "sliding_window": None,
          "layer_types": ["full_attention"] * cfg.num_layers}


FAMILY = ModelFamily(
    name="qwen3", config=Qwen3Config, module=llama.LlamaForCausalLM,
    partition_rules=PARTITION_RULES, layer_stack="layers", lookup_tables=llama.lookup_tables,
    hf=HFLayout("Qwen3ForCausalLM", config_from_hf, config_to_hf, llama.hf_tensor_names))
