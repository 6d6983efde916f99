"""A Llama-family decoder in Flax Linen, named like the Hugging Face checkpoint.

RMSNorm before each sublayer, rotary position embeddings (RoPE) on queries
and keys, grouped-query attention (num_kv_heads key/value heads shared by
num_heads query heads), a SwiGLU MLP, no biases, and an untied LM head.
Parameter names follow transformers' LlamaForCausalLM without the `model.`
prefix (embed_tokens, layers_<i>/self_attn/q_proj, ..., norm, lm_head); with
scan_layers the blocks' parameters are stacked under `layers`.
"""
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from levanter_flax.models.attention import causal_attention
from levanter_flax.models.common import attention_implementation, constrain, stack_layers

# Tensor parallelism over `model`: Q/K/V, gate and up split by output column,
# o_proj and down_proj by input row; embeddings and the head by vocabulary.
# Every parameter has a rule, so config.sharding.strict can be on.
PARTITION_RULES = (
    (r"embed_tokens/embedding$", ("model", None)),
    (r"self_attn/(q_proj|k_proj|v_proj)/kernel$", (None, "model")),
    (r"self_attn/o_proj/kernel$", ("model", None)),
    (r"mlp/(gate_proj|up_proj)/kernel$", (None, "model")),
    (r"mlp/down_proj/kernel$", ("model", None)),
    (r"lm_head/kernel$", (None, "model")),
    (r"(input_layernorm|post_attention_layernorm|norm)/scale$", (None,)),  # Replicated: small.
)


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
  rms_norm_epsilon: float = 1e-5
  initializer_range: float = 0.02
  remat: str = "none"
  dtype: str = "float32"
  param_dtype: str = "float32"
  attention_impl: str = "auto"
  scan_layers: bool = False
  cross_entropy_block_size: int = 0

  @property
  def head_dim(self) -> int:
    return self.hidden_dim // self.num_heads


def rotary_embedding(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotates x [batch, length, heads, head_dim] by positions [batch or 1, length], half-split
  as in HF Llama.

  Dimension pairs (i, i + head_dim/2) turn by position * theta^(-2i/head_dim),
  so a query-key product depends only on the two positions' difference.
  """
  half = x.shape[-1] // 2
  frequencies = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angles = positions[..., None].astype(jnp.float32) * frequencies  # [batch, length, half]
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
    q = constrain(rotary_embedding(q, positions, cfg.rope_theta), "batch", "length", "heads", None)
    k = constrain(rotary_embedding(k, positions, cfg.rope_theta), "batch", "length", "heads", None)
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
