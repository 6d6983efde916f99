"""OLMo 2: Llama with its norms after the sublayers and RMSNorm over the whole query and key.

Each block normalises the attention's and the MLP's output before adding it to the residual
stream (post_attention_layernorm, post_feedforward_layernorm); the sublayers' inputs are not
normalised (no input_layernorm). The queries and keys are RMS-normalised over the whole
projection (q_norm over num_heads * head_dim, k_norm over num_kv_heads * head_dim) before they
are cut into heads and turned by RoPE. Under tensor parallelism the projections are split by
heads, so each norm is a reduction across that split, which XLA inserts: the scales are laid out
as the projection's output. The module is Llama's attention and MLP (models/llama.py, qk_norm
"projection") in OLMo 2's block; the Hugging Face layout is Olmo2ForCausalLM's. The released
models' conventions (RoPE theta 500000, RMSNorm epsilon 1e-6, an untied head) are the defaults.
"""
import dataclasses

import flax.linen as nn
import jax

from levanter_flax.core.errors import UserError
from levanter_flax.models import hf_keys, llama
from levanter_flax.models.common import constrain
from levanter_flax.models.family import HFLayout, ModelFamily
from levanter_flax.core.schema import overridden

# The norms of the whole projection: split as the projection's output, so that each device
# scales its own columns (the mean of squares is summed across the split).
PARTITION_RULES = (
    (r"self_attn/q_norm/scale$", ("heads",)),
    (r"self_attn/k_norm/scale$", ("kv_heads",)),
    (r"post_feedforward_layernorm/scale$", ("embed",)),
) + llama.PARTITION_RULES


@dataclasses.dataclass(frozen=True)
class Olmo2Config(llama.LlamaConfig):
  architecture: str = overridden(llama.LlamaConfig, "architecture", "olmo2")
  rope_theta: float = overridden(llama.LlamaConfig, "rope_theta", 500_000.0)
  rms_norm_epsilon: float = overridden(llama.LlamaConfig, "rms_norm_epsilon", 1e-6)
  qk_norm = "projection"

  def __post_init__(self):
    super().__post_init__()
    if self.qkv_bias:
      raise UserError("config.model.qkv_bias: OLMo 2 has no query, key or value biases")


class DecoderLayer(llama.DecoderLayer):
  """x + norm(attention(x)), then x + norm(mlp(x))."""

  @nn.compact
  def __call__(self, x: jax.Array, positions_and_masks: tuple) -> jax.Array:
    cfg = self.config
    attended = llama.Attention(cfg, self.decode, name="self_attn")(x, *positions_and_masks)
    x = x + llama.rms_norm(cfg, "post_attention_layernorm")(attended)
    x = x + llama.rms_norm(cfg, "post_feedforward_layernorm")(
        self.feed_forward(cfg, name="mlp")(x))
    return constrain(x, "batch", "length", "embed")


class Olmo2ForCausalLM(llama.LlamaForCausalLM):
  decoder_layer = DecoderLayer


def config_from_hf(hf: dict) -> Olmo2Config:
  hf_keys.refuse_unless(hf, "OLMo 2", {"attention_bias": False, "hidden_act": "silu"})
  # Read as Llama's, but with transformers' Olmo2Config default epsilon where none is written.
  return Olmo2Config(**llama.llama_fields_from_hf(hf)
                     | {"rms_norm_epsilon": hf_keys.number(hf, "rms_norm_eps", 1e-5)})


def config_to_hf(cfg: Olmo2Config) -> dict:
  return {**llama.llama_fields_to_hf(cfg), "architectures": ["Olmo2ForCausalLM"],
          "model_type": "olmo2", "attention_bias": False}


def hf_tensor_names(cfg: Olmo2Config) -> dict[str, tuple[str, bool]]:
  """Llama's names (q_norm and k_norm included), with each block's two norms after its
  sublayers: post_attention_layernorm and post_feedforward_layernorm, no input_layernorm."""
  names = {ours: theirs for ours, theirs in llama.hf_tensor_names(cfg).items()
           if not ours.endswith("/input_layernorm/scale")}
  for i in range(cfg.num_layers):
    names[f"layers_{i}/post_feedforward_layernorm/scale"] = (
        f"model.layers.{i}.post_feedforward_layernorm.weight", False)
  return names


FAMILY = ModelFamily(
    name="olmo2", config=Olmo2Config, module=Olmo2ForCausalLM,
    partition_rules=PARTITION_RULES, layer_stack="layers", lookup_tables=llama.lookup_tables,
    hf=HFLayout("Olmo2ForCausalLM", config_from_hf, config_to_hf, hf_tensor_names))
