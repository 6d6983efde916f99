"""Qwen2: Llama with biases on the query, key and value projections.

Its other conventions are config values: RoPE theta 1e6, RMSNorm epsilon 1e-6,
and in the small models (0.5B, 1.5B) the token embedding as the LM head. The
module is Llama's (models/llama.py), with qkv_bias on; the Hugging Face layout
is Qwen2ForCausalLM's. Qwen2's sliding window is refused: the released models
do not use it.
"""
import dataclasses

from levanter_flax.core.errors import UserError
from levanter_flax.models import hf_keys, llama
from levanter_flax.models.family import HFLayout, ModelFamily
from levanter_flax.core.schema import overridden

PARTITION_RULES = llama.PARTITION_RULES  # Its q/k/v bias rules included.


@dataclasses.dataclass(frozen=True)
class Qwen2Config(llama.LlamaConfig):
  architecture: str = overridden(llama.LlamaConfig, "architecture", "qwen2")
  rope_theta: float = overridden(llama.LlamaConfig, "rope_theta", 1_000_000.0)
  rms_norm_epsilon: float = overridden(llama.LlamaConfig, "rms_norm_epsilon", 1e-6)
  qkv_bias: bool = overridden(llama.LlamaConfig, "qkv_bias", True)

  def __post_init__(self):
    super().__post_init__()
    if not self.qkv_bias:
      raise UserError("config.model.qkv_bias: Qwen2 always has query, key and value "
                            "biases; without them it is a Llama (architecture='llama')")


def config_from_hf(hf: dict) -> Qwen2Config:
  hf_keys.refuse_unless(hf, "Qwen2", {"use_sliding_window": False, "hidden_act": "silu"})
  return Qwen2Config(**llama.llama_fields_from_hf(hf))


def config_to_hf(cfg: Qwen2Config) -> dict:
  return {**llama.llama_fields_to_hf(cfg), "architectures": ["Qwen2ForCausalLM"],
          "model_type": "qwen2", "use_sliding_window": False}


FAMILY = ModelFamily(
    name="qwen2", config=Qwen2Config, module=llama.LlamaForCausalLM,
    partition_rules=PARTITION_RULES, layer_stack="layers", lookup_tables=llama.lookup_tables,
    hf=HFLayout("Qwen2ForCausalLM", config_from_hf, config_to_hf, llama.hf_tensor_names))
