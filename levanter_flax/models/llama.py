"""A Llama-family decoder in Flax Linen, named like the Hugging Face checkpoint.

RMSNorm before each sublayer, rotary position embeddings (RoPE) on queries
and keys (optionally rescaled: HF's "linear", "llama3" and "yarn" rope types),
grouped-query attention (num_kv_heads key/value heads shared by
num_heads query heads), a SwiGLU MLP, no biases, and an untied LM head.
Parameter names follow transformers' LlamaForCausalLM without the `model.`
prefix (embed_tokens, layers_<i>/self_attn/q_proj, ..., norm, lm_head); with
scan_layers the blocks' parameters are stacked under `layers`.
"""
import dataclasses
import math
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from levanter_flax.core.errors import UserError
from levanter_flax.models import common, hf_keys, int8, lora
from levanter_flax.models.lora import LoraConfig
from levanter_flax.models.attention import causal_attention, document_positions
from levanter_flax.models.common import (attention_implementation, check_config, constrain,
                                         stack_layers)
from levanter_flax.models.family import HFLayout, ModelFamily
from levanter_flax.core.schema import MODEL, STATE, setting

# Tensor parallelism, in logical axes (sharding.tensor_axis takes heads, kv_heads, mlp
# and vocab): Q/K/V, gate and up split by output column, o_proj and down_proj by input
# row; embeddings and the head by vocabulary. Every parameter has a rule, so
# config.sharding.strict can be on.
PARTITION_RULES = (
    (r"embed_tokens/embedding$", ("vocab", "zero3")),
    (r"self_attn/q_proj/kernel$", ("embed", "heads")),
    (r"self_attn/(k_proj|v_proj)/kernel$", ("embed", "kv_heads")),
    (r"self_attn/o_proj/kernel$", ("heads", "embed")),
    (r"self_attn/q_proj/bias$", ("heads",)),  # Only with qkv_bias (Qwen2).
    (r"self_attn/(k_proj|v_proj)/bias$", ("kv_heads",)),
    (r"mlp/(gate_proj|up_proj)/kernel$", ("embed", "mlp")),
    (r"mlp/down_proj/kernel$", ("mlp", "embed")),
    (r"lm_head/kernel$", ("embed", "vocab")),  # Only with tie_word_embeddings=False.
    (r"(input_layernorm|post_attention_layernorm|norm)/scale$", ("embed",)),  # Small: whole.
)
# The per-head query and key norms' scales [head_dim] (Qwen3, Gemma 3) are small: whole on every
# device.
PER_HEAD_NORM_RULES = ((r"self_attn/(q_norm|k_norm)/scale$", (None,)),)
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  vocab_size: int = setting(doc="Must cover the tokenizer's vocabulary", kind=STATE)
  # RoPE has no table: the same weights train at any context length.
  seq_len: int = setting(doc="Tokens per training window; a resume may change it (longer "
                         "context), and reads on in windows of the new length")
  num_layers: int = setting(doc="Transformer blocks", kind=STATE)
  num_heads: int = setting(doc="Query heads; they divide hidden_dim", kind=STATE)
  num_kv_heads: int = setting(doc="Key/value heads, each shared by num_heads / num_kv_heads query "
                              "heads (grouped-query attention)", kind=STATE)
  hidden_dim: int = setting(doc="Width of the residual stream", kind=STATE)
  intermediate_dim: int = setting(doc="Width of the SwiGLU MLP", kind=STATE)
  architecture: str = setting("llama", "The model family, a key of models.FAMILIES", STATE)
  rope_theta: float = setting(10000.0, "RoPE's base", MODEL)
  rope_type: str = setting(
      "default", "RoPE frequency scaling, as HF's rope_parameters: default (none), linear (every "
      "frequency / rope_factor), llama3 (Llama 3.1's) or yarn (YaRN: Qwen's long context, "
      "DeepSeek-V3's), from the rope_* settings below", MODEL)
  rope_factor: float = setting(1.0, "linear, llama3 and yarn: the scaling factor", MODEL)
  rope_low_freq_factor: float = setting(
      1.0, "llama3: wavelengths longer than rope_original_seq_len / this are divided by "
      "rope_factor", MODEL)
  rope_high_freq_factor: float = setting(
      4.0, "llama3: wavelengths shorter than rope_original_seq_len / this are kept; a smooth "
      "ramp between", MODEL)
  rope_original_seq_len: int = setting(
      8192, "llama3 and yarn: HF's original_max_position_embeddings, the pretraining context",
      MODEL)
  rope_beta_fast: float = setting(32.0, "yarn: pairs turning more than this often over "
                                  "rope_original_seq_len keep their rate", MODEL)
  rope_beta_slow: float = setting(1.0, "yarn: pairs turning less often than this are divided "
                                  "by rope_factor; a ramp between", MODEL)
  rope_truncate: bool = setting(True, "yarn: the ramp's ends rounded to whole pairs (HF's "
                                "truncate)", MODEL)
  rope_attention_factor: float = setting(
      0.0, "yarn: the rotated parts are scaled by this; 0: 0.1 ln(rope_factor) + 1, or with "
      "rope_mscale and rope_mscale_all_dim their ratio of such terms", MODEL)
  rope_mscale: float = setting(0.0, "yarn: HF's mscale (DeepSeek-V3's); 0: none", MODEL)
  rope_mscale_all_dim: float = setting(
      0.0, "yarn: HF's mscale_all_dim (DeepSeek-V3's; its scores are also scaled by the square "
      "of 0.1 x this x ln(rope_factor) + 1); 0: none", MODEL)
  rms_norm_epsilon: float = setting(1e-5, "RMSNorm's epsilon", MODEL)
  initializer_range: float = setting(0.02, "Standard deviation of the initial weights")
  tie_word_embeddings: bool = setting(
      False, "The token embedding is the LM head (Llama 3.2 1B)", STATE)
  qkv_bias: bool = setting(False, "Biases on the query, key and value projections: Qwen2's, "
                           "not Llama's", STATE)
  sliding_window: int = setting(
      0, "> 0: each token attends to itself and this many - 1 before (Mistral)", MODEL)
  compute: common.ComputeConfig = common.compute_section()
  lora: LoraConfig = lora.lora_section()
  has_sliding_window: ClassVar[bool] = False  # Whether the family may set sliding_window.
  # RMSNorm on the queries and keys, before RoPE: "" none, "head" each head's (over head_dim,
  # one scale shared by the heads: Qwen3), "projection" the whole projection's (over
  # num_heads * head_dim, or num_kv_heads * head_dim: OLMo 2).
  qk_norm: ClassVar[str] = ""

  def __post_init__(self):
    check_config(self, ("vocab_size", "seq_len", "num_layers", "num_heads", "num_kv_heads",
                        "hidden_dim", "intermediate_dim", "rope_original_seq_len"))
    if self.num_heads % self.num_kv_heads:
      raise UserError(f"config.model.num_heads ({self.num_heads}) must be a multiple of "
                      f"config.model.num_kv_heads ({self.num_kv_heads})")
    if self.qkv_bias and self.architecture == "llama":
      raise UserError("config.model.qkv_bias: a Llama with query, key and value biases is a "
                      "Qwen2; set config.model.architecture='qwen2'")
    if self.sliding_window and not self.has_sliding_window:
      raise UserError(f"config.model.sliding_window: {self.architecture} has no sliding window; "
                      f"Mistral does (architecture='mistral')")
    if self.sliding_window < 0:
      raise UserError(f"config.model.sliding_window must be >= 0 (0: none); "
                      f"got {self.sliding_window}")
    # config.py builds this from config.model; an unknown rope type must not silently mean none.
    if self.rope_type not in ROPE_TYPES:
      raise UserError(f"config.model.rope_type must be one of {', '.join(ROPE_TYPES)}; "
                      f"got {self.rope_type!r}")
    if self.rope_type != "default" and not self.rope_factor > 0:
      raise UserError(f"config.model.rope_factor must be positive; got {self.rope_factor!r}")
    if self.rope_type == "yarn" and not 0 < self.rope_beta_slow < self.rope_beta_fast:
      raise UserError(f"config.model.rope_beta_slow ({self.rope_beta_slow}) must be positive and "
                      f"below rope_beta_fast ({self.rope_beta_fast})")
    low, high = self.rope_low_freq_factor, self.rope_high_freq_factor
    if self.rope_type == "llama3" and not 0 < low < high:  # The ramp divides by high - low.
      raise UserError(f"config.model.rope_low_freq_factor ({self.rope_low_freq_factor}) must be "
                      f"positive and below rope_high_freq_factor ({self.rope_high_freq_factor})")

  @property
  def head_dim(self) -> int:
    """Each attention head's width: hidden_dim / num_heads. A family whose heads are wider or
    narrower (Qwen3) declares head_dim as a setting of its own, which shadows this."""
    return self.hidden_dim // self.num_heads


def head_dim_setting(example: str):
  """The head_dim setting of a family whose heads are not hidden_dim / num_heads wide (Llama's
  property): 0 is resolved once, by resolve_head_dim, and stored resolved, so a
  dataclasses.replace that changes the width or the heads keeps it."""
  return setting(0, f"Width of each attention head (query, key and value); 0: hidden_dim / "
                 f"num_heads. {example}", STATE)


def resolve_head_dim(cfg: LlamaConfig) -> None:
  """Checks a head_dim setting (head_dim_setting's) and stores 0 as hidden_dim / num_heads."""
  if cfg.head_dim < 0 or cfg.head_dim % 2:
    raise UserError(f"config.model.head_dim must be even (RoPE turns pairs) and >= 0 (0: "
                    f"hidden_dim / num_heads); got {cfg.head_dim}")
  if not cfg.head_dim:
    object.__setattr__(cfg, "head_dim", cfg.hidden_dim // cfg.num_heads)


def rope_frequencies(cfg: LlamaConfig, dims: int | None = None) -> np.ndarray:
  """The rotation rate of each dimension pair, [dims / 2] float32: theta^(-2i/dims), rescaled
  per cfg.rope_type the way transformers' modeling_rope_utils does. dims: the rotated width,
  by default head_dim (DeepSeek-V3 turns only part of each head)."""
  half = (dims or cfg.head_dim) // 2
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
  elif cfg.rope_type == "yarn":
    # Pairs that turn fewer than beta_slow times over the original context are interpolated
    # (divided by the factor), those turning more than beta_fast times kept; a ramp between,
    # over pair indices (the correction range), as transformers' _compute_yarn_parameters.
    dims = 2 * half
    pair_of = lambda turns: dims * math.log(cfg.rope_original_seq_len / (turns * 2 * math.pi)) / (
        2 * math.log(cfg.rope_theta))
    low, high = pair_of(cfg.rope_beta_fast), pair_of(cfg.rope_beta_slow)
    if cfg.rope_truncate:
      low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    ramp = np.clip((np.arange(half) - low) / (high - low if high != low else 0.001), 0, 1)
    frequencies = frequencies / cfg.rope_factor * ramp + frequencies * (1 - ramp)
  return frequencies.astype(np.float32)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(cfg: LlamaConfig) -> float:
  """What the rotated parts of queries and keys are scaled by: YaRN's attention factor, else 1."""
  if cfg.rope_type != "yarn":
    return 1.0
  if cfg.rope_attention_factor:
    return cfg.rope_attention_factor
  if cfg.rope_mscale and cfg.rope_mscale_all_dim:
    return (_yarn_mscale(cfg.rope_factor, cfg.rope_mscale)
            / _yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim))
  return _yarn_mscale(cfg.rope_factor)


def yarn_score_scale(cfg: LlamaConfig) -> float:
  """DeepSeek's further factor on attention scores under scaled RoPE: the square of mscale
  at rope_mscale_all_dim (transformers' yarn_apply_mscale), else 1."""
  if cfg.rope_type == "default" or not cfg.rope_mscale_all_dim:
    return 1.0
  return _yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim) ** 2


def rotary_embedding(x: jax.Array, positions: jax.Array, frequencies: np.ndarray,
                     scale: float = 1.0) -> jax.Array:
  """Rotates x [batch, length, heads, head_dim] by positions [batch or 1, length], half-split
  as in HF Llama, and scales it by `scale` (rope_attention_factor: YaRN's).

  Dimension pairs (i, i + head_dim/2) turn by position * frequencies[i] (rope_frequencies),
  so a query-key product depends only on the two positions' difference.
  """
  head_dim = x.shape[-1]
  half = head_dim // 2
  angles = positions[..., None].astype(jnp.float32) * jnp.asarray(frequencies)  # [b, length, half]
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None]  # Each pair's, on both its dims.
  # Each dim's partner, signed: (-x[half:], x[:half]), as a product with a signed permutation.
  # Sliced out instead, the 32-wide halves of 64-wide heads each fill a TPU's 128 lanes: the
  # rotation took 9% of a 0.47B Llama's step on a v5e chip. The product takes x in float32, so
  # that its gradient stays float32 until the one rounding to x's dtype; a TPU's one bfloat16
  # pass is exact for bfloat16 x (and rounds the gradient's partner terms once more), any
  # other dtype takes the exact passes.
  swap = np.zeros((head_dim, head_dim), np.float32)
  swap[np.arange(half) + half, np.arange(half)] = -1.0
  swap[np.arange(half), np.arange(half) + half] = 1.0
  x32 = x.astype(jnp.float32)
  precision = (jax.lax.Precision.DEFAULT if x.dtype == jnp.bfloat16
               else jax.lax.Precision.HIGHEST)
  partner = jnp.einsum("...d,de->...e", x32, jnp.asarray(swap), precision=precision)
  rotated = x32 * (scale * jnp.cos(angles)) + partner * (scale * jnp.sin(angles))
  return rotated.astype(x.dtype)


def _dense(features: int, cfg: LlamaConfig, name: str, use_bias: bool = False,
           layer: bool = True) -> lora.Dense:
  """A projection; `layer`: one of the layers' (int8 under quantization), not the head."""
  return lora.Dense(features, use_bias=use_bias, dtype=cfg.compute.dtype,
                    param_dtype=cfg.compute.param_dtype,
                    kernel_init=nn.initializers.normal(cfg.initializer_range),
                    bias_init=nn.initializers.zeros, lora=cfg.lora, name=name,
                    dot_general=int8.layer_dot_general(cfg.compute) if layer else None)


def rms_norm(cfg: LlamaConfig, name: str) -> nn.RMSNorm:
  return nn.RMSNorm(epsilon=cfg.rms_norm_epsilon, dtype=cfg.compute.dtype, param_dtype=cfg.compute.param_dtype,
                    name=name)


class Attention(nn.Module):
  config: LlamaConfig
  decode: bool = False

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array, token_mask: jax.Array | None = None,
               segment_ids: jax.Array | None = None) -> jax.Array:
    cfg = self.config
    batch, length, _ = x.shape
    q = _dense(cfg.num_heads * cfg.head_dim, cfg, "q_proj", cfg.qkv_bias)(x)
    k, v = (_dense(cfg.num_kv_heads * cfg.head_dim, cfg, name, cfg.qkv_bias)(x)
            for name in ("k_proj", "v_proj"))
    if cfg.qk_norm == "projection":  # Over the whole width: a reduction across the heads' split.
      q, k = rms_norm(cfg, "q_norm")(q), rms_norm(cfg, "k_norm")(k)
    q = q.reshape(batch, length, cfg.num_heads, cfg.head_dim)
    k, v = (t.reshape(batch, length, cfg.num_kv_heads, cfg.head_dim) for t in (k, v))
    if cfg.qk_norm == "head":
      q, k = rms_norm(cfg, "q_norm")(q), rms_norm(cfg, "k_norm")(k)
    frequencies, scale = rope_frequencies(cfg), rope_attention_factor(cfg)
    q = constrain(rotary_embedding(q, positions, frequencies, scale), "batch", "length", "heads",
                  None)
    k = constrain(rotary_embedding(k, positions, frequencies, scale), "batch", "length", "heads",
                  None)
    v = constrain(v, "batch", "length", "heads", None)
    # Each key/value head is shared among num_heads / num_kv_heads queries (XLA and splash alike).
    out = causal_attention(self, q, k, v, implementation=attention_implementation(cfg),
                           splash_blocks=cfg.compute.splash_blocks,
                           decode=self.decode, token_mask=token_mask, window=cfg.sliding_window,
                           segment_ids=segment_ids, cache_dtype=common.cache_dtype(cfg.compute))
    return _dense(cfg.hidden_dim, cfg, "o_proj")(
        out.reshape(batch, length, cfg.num_heads * cfg.head_dim))


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
  # Another family's blocks may swap them (Mixtral's mixture of experts, DeepSeek's attention).
  attention = Attention
  feed_forward = MLP

  @nn.compact
  def __call__(self, x: jax.Array, positions_and_masks: tuple) -> jax.Array:
    x = x + self.attention(self.config, self.decode, name="self_attn")(
        rms_norm(self.config, "input_layernorm")(x), *positions_and_masks)
    x = x + self.feed_forward(self.config, name="mlp")(
        rms_norm(self.config, "post_attention_layernorm")(x))
    return constrain(x, "batch", "length", "embed")


class LlamaForCausalLM(nn.Module):
  """Maps tokens [batch, length] to next-token logits [batch, length, vocab].

  With return_hidden it returns the final normed hidden states instead, for a
  loss that applies `output_embedding` a block of the vocabulary at a time.
  With decode=True it runs on a KV cache (see attention.py); positions [batch, length] and
  token_mask then place each row at its own position (generate/engine.py's slots), and
  logits_at [batch, n] keeps only those positions' logits. With segment_ids [batch, length]
  (document masking), attention stays within each segment and positions restart at each (RoPE
  is relative, so the restart changes nothing but rounding).
  """
  config: LlamaConfig
  decode: bool = False
  decoder_layer = DecoderLayer

  @nn.compact
  def __call__(self, tokens: jax.Array, return_hidden: bool = False,
               positions: jax.Array | None = None,
               token_mask: jax.Array | None = None,
               segment_ids: jax.Array | None = None,
               logits_at: jax.Array | None = None) -> jax.Array:
    cfg = self.config
    embed = nn.Embed(cfg.vocab_size, cfg.hidden_dim, dtype=cfg.compute.dtype, param_dtype=cfg.compute.param_dtype,
                     embedding_init=nn.initializers.normal(cfg.initializer_range),
                     name="embed_tokens")
    x = constrain(embed(tokens), "batch", "length", "embed")
    if positions is None:
      positions = (jnp.arange(tokens.shape[1])[None] if segment_ids is None
                   else document_positions(segment_ids))
    x = self.blocks(x, (positions, token_mask, segment_ids))
    x = rms_norm(cfg, "norm")(x)
    if logits_at is not None:  # Only these positions' logits [batch, n]: decoding's last tokens.
      x = jnp.take_along_axis(x, logits_at[..., None], axis=1)
    if return_hidden:
      return x
    logits = embed.attend(x) if cfg.tie_word_embeddings else _dense(cfg.vocab_size, cfg,
                                                                     "lm_head", layer=False)(x)
    return constrain(logits, "batch", "length", "vocab")

  def blocks(self, x: jax.Array, positions_and_masks: tuple) -> jax.Array:
    """The decoder layers, in __call__'s scope; a family whose layers differ stacks each kind."""
    return stack_layers(self.decoder_layer, self.config, self.decode, "layers", x,
                        positions_and_masks)

  @staticmethod
  def output_embedding(params) -> jax.Array:
    """The LM head as [vocab, hidden_dim]: its own, or the token embedding when tied."""
    if "lm_head" in params:
      return params["lm_head"]["kernel"].T
    return params["embed_tokens"]["embedding"]


# Hugging Face's LlamaForCausalLM. Its Linear weights are [out, in]: transposed. RoPE needs no
# permutation: HF's layout is the half-split one used here.


def config_from_hf(hf: dict) -> LlamaConfig:
  hf_keys.refuse_unless(hf, "Llama", {"attention_bias": False, "mlp_bias": False,
                                      "hidden_act": "silu"})
  return LlamaConfig(**llama_fields_from_hf(hf))


def llama_fields_from_hf(hf: dict, head_dim: int | None = None) -> dict[str, Any]:
  """LlamaConfig's fields from a config.json of the Llama kind (Llama, Qwen2, Mistral, ...).

  head_dim: for a family with a head_dim setting (Qwen3), transformers' default for the key,
  which is then read into the fields; else a head_dim other than hidden_size / heads is refused.
  """
  heads, hidden_dim = hf_keys.integer(hf, "num_attention_heads"), hf_keys.integer(hf, "hidden_size")
  if head_dim is not None:
    decoupled = {"head_dim": hf_keys.integer(hf, "head_dim", head_dim)}
  else:
    decoupled = {}
    if hf_keys.integer(hf, "head_dim", hidden_dim // heads) * heads != hidden_dim:
      raise UserError(f"head_dim {hf['head_dim']} x {heads} heads != hidden_size {hidden_dim}: "
                      f"not supported")
  seq_len = hf_keys.integer(hf, "max_position_embeddings")
  tied = hf_keys.boolean(hf, "tie_word_embeddings", False)
  return dict(vocab_size=hf_keys.integer(hf, "vocab_size"), seq_len=seq_len,
              num_layers=hf_keys.integer(hf, "num_hidden_layers"), num_heads=heads,
              num_kv_heads=hf_keys.integer(hf, "num_key_value_heads", heads),
              hidden_dim=hidden_dim, intermediate_dim=hf_keys.integer(hf, "intermediate_size"),
              rms_norm_epsilon=hf_keys.number(hf, "rms_norm_eps", 1e-6),
              initializer_range=hf_keys.number(hf, "initializer_range", 0.02),
              tie_word_embeddings=tied, **_rope_from_hf(hf, seq_len), **decoupled)


def _rope_from_hf(hf: dict, seq_len: int) -> dict[str, Any]:
  """LlamaConfig's rope_* fields from rope_parameters (transformers 5) or rope_scaling (4.x).

  Like transformers 5, a non-empty rope_scaling wins over rope_parameters, and a rope_theta
  inside the dictionary over the top-level one.
  """
  key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
  rope = hf.get(key) or {}
  if not isinstance(rope, dict):
    raise UserError(f"{key} must be an object, got {rope!r}")
  where = f"{key}."
  type_key = "rope_type" if "rope_type" in rope or "type" not in rope else "type"  # 4.x: "type".
  rope_type = rope.get(type_key, "default")
  partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor")) or 1.0
  if partial != 1:
    raise UserError(f"partial_rotary_factor={partial!r} is not supported (only 1.0)")
  theta = hf_keys.number(rope, "rope_theta", None, where) or hf_keys.number(hf, "rope_theta", 10000.0)
  if rope_type == "default":
    return {"rope_theta": theta}
  if rope_type not in ROPE_TYPES:
    raise UserError(f"{where}{type_key}={rope_type!r} is not supported (only "
                    f"{', '.join(ROPE_TYPES)})")
  if rope_type == "yarn":
    return {"rope_theta": theta, "rope_type": rope_type, **_yarn_from_hf(hf, rope, where, seq_len)}
  fields = {"rope_theta": theta, "rope_type": rope_type,
            "rope_factor": hf_keys.number(rope, "factor", where=where)}
  if rope_type == "llama3":
    # As transformers: a top-level original_max_position_embeddings first, max_position_embeddings
    # last.
    original = hf_keys.integer(hf, "original_max_position_embeddings", None) or hf_keys.integer(
        rope, "original_max_position_embeddings", seq_len, where)
    low = hf_keys.number(rope, "low_freq_factor", where=where)
    high = hf_keys.number(rope, "high_freq_factor", where=where)
    if low >= high:  # The ramp between them divides by high - low.
      raise UserError(f"{where}low_freq_factor {low} must be below {where}high_freq_factor {high}")
    fields |= {"rope_low_freq_factor": low, "rope_high_freq_factor": high,
               "rope_original_seq_len": original}
  return fields


def _yarn_from_hf(hf: dict, rope: dict, where: str, seq_len: int) -> dict[str, Any]:
  """The yarn rope_* fields, read as transformers' _compute_yarn_parameters reads them: no
  factor means max_position_embeddings / original_max_position_embeddings (DeepSeek-V3's), and
  a missing, null or zero beta, mscale or attention_factor its default."""
  original = hf_keys.integer(rope, "original_max_position_embeddings", None, where) or (
      hf_keys.integer(hf, "original_max_position_embeddings"))
  optional = lambda key, default=0.0: (hf_keys.number(rope, key, where=where) if rope.get(key)
                                       else default)
  return {"rope_factor": optional("factor", seq_len / original), "rope_original_seq_len": original,
          "rope_beta_fast": optional("beta_fast", 32.0), "rope_beta_slow": optional("beta_slow", 1.0),
          "rope_truncate": hf_keys.boolean(rope, "truncate", True),
          "rope_attention_factor": optional("attention_factor"),
          "rope_mscale": optional("mscale"), "rope_mscale_all_dim": optional("mscale_all_dim")}


def config_to_hf(cfg: LlamaConfig) -> dict:
  return {**llama_fields_to_hf(cfg), "architectures": ["LlamaForCausalLM"], "model_type": "llama",
          "attention_bias": False, "mlp_bias": False}


def llama_fields_to_hf(cfg: LlamaConfig) -> dict:
  """The config.json keys every model of the Llama kind (Llama, Qwen2, Mistral) shares."""
  return {**_rope_to_hf(cfg), "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.seq_len,
          "hidden_size": cfg.hidden_dim, "intermediate_size": cfg.intermediate_dim,
          "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
          "num_key_value_heads": cfg.num_kv_heads, "rms_norm_eps": cfg.rms_norm_epsilon,
          "rope_theta": cfg.rope_theta, "hidden_act": "silu",
          "tie_word_embeddings": cfg.tie_word_embeddings,
          "initializer_range": cfg.initializer_range}


def _rope_to_hf(cfg: LlamaConfig) -> dict:
  """The RoPE scaling keys, or none; both spellings, so transformers 4 (rope_scaling) and 5
  (rope_parameters, which it gives rope_scaling precedence over) read the same thing."""
  if cfg.rope_type == "default":
    return {}
  rope = {"rope_type": cfg.rope_type, "factor": cfg.rope_factor}
  if cfg.rope_type == "llama3":
    rope |= {"low_freq_factor": cfg.rope_low_freq_factor,
             "high_freq_factor": cfg.rope_high_freq_factor,
             "original_max_position_embeddings": cfg.rope_original_seq_len}
  if cfg.rope_type == "yarn":
    rope |= {"original_max_position_embeddings": cfg.rope_original_seq_len,
             "beta_fast": cfg.rope_beta_fast, "beta_slow": cfg.rope_beta_slow,
             "truncate": cfg.rope_truncate}
    rope |= {key: value for key, value in (("attention_factor", cfg.rope_attention_factor),
                                           ("mscale", cfg.rope_mscale),
                                           ("mscale_all_dim", cfg.rope_mscale_all_dim)) if value}
  return {"rope_scaling": rope, "rope_parameters": {**rope, "rope_theta": cfg.rope_theta}}


def hf_tensor_names(cfg: LlamaConfig) -> dict[str, tuple[str, bool]]:
  """Our parameter path -> (HF tensor name, transposed?); the same for Qwen2, Mistral and Qwen3."""
  names = {"embed_tokens/embedding": ("model.embed_tokens.weight", False),
           "norm/scale": ("model.norm.weight", False)}
  if not cfg.tie_word_embeddings:
    names["lm_head/kernel"] = ("lm_head.weight", True)
  for i in range(cfg.num_layers):
    prefix = f"model.layers.{i}"
    for norm in ("input_layernorm", "post_attention_layernorm"):
      names[f"layers_{i}/{norm}/scale"] = (f"{prefix}.{norm}.weight", False)
    for part in ("q_proj", "k_proj", "v_proj", "o_proj"):
      names[f"layers_{i}/self_attn/{part}/kernel"] = (f"{prefix}.self_attn.{part}.weight", True)
    if cfg.qk_norm:
      for norm in ("q_norm", "k_norm"):
        names[f"layers_{i}/self_attn/{norm}/scale"] = (f"{prefix}.self_attn.{norm}.weight", False)
    if cfg.qkv_bias:
      for part in ("q_proj", "k_proj", "v_proj"):
        names[f"layers_{i}/self_attn/{part}/bias"] = (f"{prefix}.self_attn.{part}.bias", False)
    for part in ("gate_proj", "up_proj", "down_proj"):
      names[f"layers_{i}/mlp/{part}/kernel"] = (f"{prefix}.mlp.{part}.weight", True)
  return names


def lookup_tables(params: dict) -> tuple[str, ...]:
  """The token embedding is only looked up, unless tied: then it is the LM head's matmul too."""
  return ("embed_tokens",) if "lm_head" in params else ()


FAMILY = ModelFamily(
    name="llama", config=LlamaConfig, module=LlamaForCausalLM, partition_rules=PARTITION_RULES,
    layer_stack="layers", lookup_tables=lookup_tables,
    hf=HFLayout("LlamaForCausalLM", config_from_hf, config_to_hf, hf_tensor_names))
