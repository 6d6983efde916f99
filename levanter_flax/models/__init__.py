"""The model families: each one's config dataclass, Flax module and partition rules."""
import flax.linen as nn

from levanter_flax.models import gpt2, llama

CONFIGS = {"gpt2": gpt2.GPT2Config, "llama": llama.LlamaConfig}
PARTITION_RULES = {"gpt2": gpt2.PARTITION_RULES, "llama": llama.PARTITION_RULES}


def build(cfg, decode: bool = False) -> nn.Module:
  """The Flax module for a model config (GPT2Config or LlamaConfig); decode: on a KV cache."""
  module = {"gpt2": gpt2.GPT2LMHeadModel, "llama": llama.LlamaForCausalLM}[cfg.architecture]
  return module(cfg, decode=decode)
