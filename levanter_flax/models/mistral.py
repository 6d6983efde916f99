"""Mistral: Llama with sliding-window attention.

Each token attends to itself and the sliding_window - 1 tokens before it, in
training and on the KV cache (models/attention.py); Mistral 7B v0.1's window
is 4096, and later versions (v0.3) have none (0). The module is Llama's; the
Hugging Face layout is MistralForCausalLM's.
"""
import dataclasses

from levanter_flax.models import hf_keys, llama
from levanter_flax.models.family import HFLayout, ModelFamily
from levanter_flax.core.schema import overridden

PARTITION_RULES = llama.PARTITION_RULES


@dataclasses.dataclass(frozen=True)
class MistralConfig(llama.LlamaConfig):
  architecture: str = overridden(llama.LlamaConfig, "architecture", "mistral")
  sliding_window: int = overridden(llama.LlamaConfig, "sliding_window", 4096)
  has_sliding_window = True


def config_from_hf(hf: dict) -> MistralConfig:
  hf_keys.refuse_unless(hf, "Mistral", {"hidden_act": "silu", "tie_word_embeddings": False})
  window = hf_keys.integer(hf, "sliding_window", 0)  # null: none.
  return MistralConfig(**llama.llama_fields_from_hf(hf), sliding_window=window)


def config_to_hf(cfg: MistralConfig) -> dict:
  return {**llama.llama_fields_to_hf(cfg), "architectures": ["MistralForCausalLM"],
          "model_type": "mistral", "sliding_window": cfg.sliding_window or None}


FAMILY = ModelFamily(
    name="mistral", config=MistralConfig, module=llama.LlamaForCausalLM,
    partition_rules=PARTITION_RULES, layer_stack="layers", lookup_tables=llama.lookup_tables,
    hf=HFLayout("MistralForCausalLM", config_from_hf, config_to_hf, llama.hf_tensor_names))
