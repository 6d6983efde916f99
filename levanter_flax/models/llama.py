"""A Llama-family decoder in Flax Linen, named like the Hugging Face checkpoint.

RMSNorm before each sublayer, rotary position embeddings (RoPE) on queries
and keys (optionally rescaled: HF's "linear" and "llama3" rope types),
grouped-query attention (num_kv_heads key/value heads shared by
num_heads query heads), a SwiGLU MLP, no biases, and an untied LM head.
Parameter names follow transformers' LlamaForCausalLM without the `model.`
prefix (embed_tokens, layers_<i>/self_attn/q_proj, ..., norm, lm_head); with
scan_layers the blocks' parameters are stacked under `layers`.
"""
import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from levanter_flax.errors import UserError
from levanter_flax.models.attention import causal_attention
from levanter_flax.models.common import attention_implementation, constrain, stack_layers

# Tensor parallelism, in logical axes (sharding.tensor_axis takes heads, kv_heads, mlp
# and vocab): Q/K/V, gate and up split by output column, o_proj and down_proj by input
# row; embeddings and the head by vocabulary. Every parameter has a rule, so
# config.sharding.strict can be on.
PARTITION_RULES = (
    (r"embed_tokens/embedding$", ("vocab", "embed")),
    (r"self_attn/q_proj/kernel$", ("embed", "heads")),
    (r"self_attn/(k_proj|v_proj)/kernel$", ("embed", "kv_heads")),
    (r"self_attn/o_proj/kernel$", ("heads", "embed")),
    (r"mlp/(gate_proj|up_proj)/kernel$", ("embed", "mlp")),
    (r"mlp/down_proj/kernel$", ("mlp", "embed")),
    (r"lm_head/kernel$", ("embed", "vocab")),
    (r"(input_layernorm|post_attention_layernorm|norm)/scale$", ("embed",)),  # Small: whole.
)
ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  vocab_size: int
  seq_len: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  hidden_dim: int
  intermediate_dim: int
  architecture: str = "llama"
  rope_theta: float = 10000.0
  # RoPE frequency scaling, as HF's rope_parameters: "default" (none), "linear" (every frequency
  # / rope_factor) or "llama3" (Llama 3.1's: wavelengths longer than rope_original_seq_len /
  # rope_low_freq_factor / rope_factor, shorter than rope_original_seq_len / rope_high_freq_factor
  # kept, a smooth ramp between). The rope_* fields below are read only by those types.
  rope_type: str = "default"
  rope_factor: float = 1.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_seq_len: int = 8192  # HF's original_max_position_embeddings: the pretraining one.
  rms_norm_epsilon: float = 1e-5
  initializer_range: float = 0.02
  remat: str = "none"
  dtype: str = "float32"
  param_dtype: str = "float32"
  attention_impl: str = "auto"
  scan_layers: bool = False
  cross_entropy_block_size: int = 0

  def __post_init__(self):
    # config.py builds this from config.model; an unknown rope type must not silently mean none.
    if self.rope_type not in ROPE_TYPES:
      raise UserError(f"config.model.rope_type must be one of {', '.join(ROPE_TYPES)}; "
                      f"got {self.rope_type!r}")
    if self.rope_type != "default" and not self.rope_factor > 0:
      raise UserError(f"config.model.rope_factor must be positive; got {self.rope_factor!r}")
    low, high = self.rope_low_freq_factor, self.rope_high_freq_factor
    if self.rope_type == "llama3" and not 0 < low < high:  # The ramp divides by high - low.
      raise UserError(f"config.model.rope_low_freq_factor ({self.rope_low_freq_factor}) must be "
                      f"positive and below rope_high_freq_factor ({self.rope_high_freq_factor})")

  @property
  def head_dim(self) -> int:
    return self.hidden_dim // self.num_heads


def rope_frequencies(cfg: LlamaConfig) -> np.ndarray:
  """The rotation rate of each dimension pair, [head_dim / 2] float32: theta^(-2i/head_dim),
  rescaled per cfg.rope_type the way transformers' modeling_rope_utils does."""
  half = cfg.head_dim // 2
  frequencies = cfg.rope_theta ** (-np.arange(half, dtype=np.float64) / half)
  if cfg.rope_type == "linear":  # Positions / factor, folded into the rates.
    frequencies = frequencies / cfg.rope_factor
  elif cfg.rope_type == "llama3":
    # Long wavelengths (slow pairs) are interpolated by the factor, short ones kept as trained;
    # in between, the rate blends the two linearly in original_seq_len / wavelength.
    wavelengths = 2 * math.pi / frequencies
    low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    original = cfg.rope_original_seq_len
    smooth = (original / wavelengths - low) / (high - low)
    blended = (1 - smooth) * frequencies / cfg.rope_factor + smooth * frequencies
    frequencies = np.where(wavelengths > original / low, frequencies / cfg.rope_factor,
                           np.where(wavelengths < original / high, frequencies, blended))
  return frequencies.astype(np.float32)


def rotary_embedding(x: jax.Array, positions: jax.Array, frequencies: np.ndarray) -> jax.Array:
  """Rotates x [batch, length, heads, head_dim] by positions [batch or 1, length], half-split
  as in HF Llama.

  Dimension pairs (i, i + head_dim/2) turn by position * frequencies[i] (rope_frequencies),
  so a query-key product depends only on the two positions' difference.
  """
  half = x.shape[-1] // 2
  angles = positions[..., None].astype(jnp.float32) * jnp.asarray(frequencies)  # [b, length, half]
  cos, sin = jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]
  first, second = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
  return rotated.astype(x.dtype)


def _dense(features: int, cfg: LlamaConfig, name: str) -> nn.Dense:
  return nn.Dense(features, use_bias=False, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                  kernel_init=nn.initializers.normal(cfg.initializer_range), name=name)


def _rms_norm(cfg: LlamaConfig, name: str) -> nn.RMSNorm:
  return nn.RMSNorm(epsilon=cfg.rms_norm_epsilon, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                    name=name)


class Attention(nn.Module):
  config: LlamaConfig
  decode: bool = False

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array,
               token_mask: jax.Array | None = None) -> jax.Array:
    cfg = self.config
    batch, length, _ = x.shape
    q = _dense(cfg.num_heads * cfg.head_dim, cfg, "q_proj")(x).reshape(
        batch, length, cfg.num_heads, cfg.head_dim)
    k, v = (_dense(cfg.num_kv_heads * cfg.head_dim, cfg, name)(x).reshape(
        batch, length, cfg.num_kv_heads, cfg.head_dim) for name in ("k_proj", "v_proj"))
    frequencies = rope_frequencies(cfg)
    q = constrain(rotary_embedding(q, positions, frequencies), "batch", "length", "heads", None)
    k = constrain(rotary_embedding(k, positions, frequencies), "batch", "length", "heads", None)
    v = constrain(v, "batch", "length", "heads", None)
    # dot_product_attention shares each key/value head among num_heads / num_kv_heads queries.
    out = causal_attention(self, q, k, v, implementation=attention_implementation(cfg),
                           decode=self.decode, token_mask=token_mask)
    return _dense(cfg.hidden_dim, cfg, "o_proj")(out.reshape(batch, length, cfg.hidden_dim))


class MLP(nn.Module):
  config: LlamaConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    gate = _dense(cfg.intermediate_dim, cfg, "gate_proj")(x)
    up = _dense(cfg.intermediate_dim, cfg, "up_proj")(x)
    return _dense(cfg.hidden_dim, cfg, "down_proj")(
        constrain(nn.silu(gate) * up, "batch", "length", "mlp"))


class DecoderLayer(nn.Module):
  config: LlamaConfig
  decode: bool = False

  @nn.compact
  def __call__(self, x: jax.Array, positions_and_mask: tuple) -> jax.Array:
    x = x + Attention(self.config, self.decode, name="self_attn")(
        _rms_norm(self.config, "input_layernorm")(x), *positions_and_mask)
    x = x + MLP(self.config, name="mlp")(_rms_norm(self.config, "post_attention_layernorm")(x))
    return constrain(x, "batch", "length", "embed")


class LlamaForCausalLM(nn.Module):
  """Maps tokens [batch, length] to next-token logits [batch, length, vocab].

  With return_hidden it returns the final normed hidden states instead, for a
  loss that applies `output_embedding` a block of the vocabulary at a time.
  With decode=True it runs on a KV cache (see attention.py); positions
  [batch, length] and token_mask then place left-padded prompts.
  """
  config: LlamaConfig
  decode: bool = False

  @nn.compact
  def __call__(self, tokens: jax.Array, return_hidden: bool = False,
               positions: jax.Array | None = None,
               token_mask: jax.Array | None = None) -> jax.Array:
    cfg = self.config
    embed = nn.Embed(cfg.vocab_size, cfg.hidden_dim, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                     embedding_init=nn.initializers.normal(cfg.initializer_range),
                     name="embed_tokens")
    x = constrain(embed(tokens), "batch", "length", "embed")
    if positions is None:
      positions = jnp.arange(tokens.shape[1])[None]
    x = stack_layers(DecoderLayer, cfg, self.decode, "layers", x, (positions, token_mask))
    x = _rms_norm(cfg, "norm")(x)
    if return_hidden:
      return x
    return constrain(_dense(cfg.vocab_size, cfg, "lm_head")(x), "batch", "length", "vocab")

  @staticmethod
  def output_embedding(params) -> jax.Array:
    """The LM head as [vocab, hidden_dim]."""
    return params["lm_head"]["kernel"].T
