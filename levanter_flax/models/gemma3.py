"""Gemma 3 (text): local sliding-window layers and global layers interleaved, each with its RoPE.

Per layer, as transformers' Gemma3ForCausalLM: the input normed, attention, its output normed
(post_attention_layernorm) and added; then pre_feedforward_layernorm, a GeGLU MLP (gelu with the
tanh approximation, gate * up) and post_feedforward_layernorm before the add. Every RMSNorm is
Gemma's: computed in float32 as x / rms(x) * (1 + w), w initialised to 0. Queries and keys are
RMS-normalised per head (q_norm, k_norm over head_dim) before RoPE; attention scores are scaled
by query_pre_attn_scalar ** -0.5, not head_dim's. Token embeddings are multiplied by
sqrt(hidden_dim), cast to the compute dtype first (as transformers casts it to the weights');
the LM head is the token embedding unless tie_word_embeddings is off; where
final_logit_softcapping is set, logits are c * tanh(logits / c).

Layers are local (a sliding window of sliding_window tokens, RoPE base rope_local_theta) or
global (full causal attention, RoPE base rope_theta with the rope_* scaling): every
sliding_window_pattern-th layer is global (Gemma 3's 5 local : 1 global), or layer_types names
each. Unrolled, each layer's kind is static; with scan_layers it is the scan's per-layer input
(common.stack_layers' per_layer), the RoPE rates picked by a select and the attention by a
lax.cond between the two static masks (attention.causal_attention's `windowed`), so splash
attention serves both kinds either way. The parameters are the same scanned or not.

Refused, one line each: attention-logit soft-capping (attn_logit_softcapping), bidirectional
attention, attention biases, another activation, layer kinds other than sliding_attention and
full_attention, RoPE scaling other than linear on the global layers or any on the local ones,
and the final soft-cap together with the blockwise loss (compute.cross_entropy_block_size,
which never forms the logits it would cap).
"""
import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from levanter_flax.core.errors import UserError
from levanter_flax.models import hf_keys, llama
from levanter_flax.models.attention import causal_attention, document_positions
from levanter_flax.models.common import (attention_implementation, cache_dtype, constrain,
                                         stack_layers)
from levanter_flax.models.family import HFLayout, ModelFamily
from levanter_flax.core.schema import MODEL, overridden, setting

# The four block norms are Llama's rule's (norm/scale$).
PARTITION_RULES = llama.PER_HEAD_NORM_RULES + llama.PARTITION_RULES
# transformers' Gemma3TextConfig defaults where config.json has no value.
HF_HEAD_DIM = 256
HF_PATTERN = 6
LOCAL, GLOBAL = "sliding_attention", "full_attention"  # transformers' layer_types.
GLOBAL_ROPE_TYPES = ("default", "linear")


@dataclasses.dataclass(frozen=True)
class Gemma3Config(llama.LlamaConfig):
  architecture: str = overridden(llama.LlamaConfig, "architecture", "gemma3")
  rope_theta: float = overridden(llama.LlamaConfig, "rope_theta", 1_000_000.0)
  rms_norm_epsilon: float = overridden(llama.LlamaConfig, "rms_norm_epsilon", 1e-6)
  tie_word_embeddings: bool = overridden(llama.LlamaConfig, "tie_word_embeddings", True)
  sliding_window: int = overridden(llama.LlamaConfig, "sliding_window", 4096)
  head_dim: int = llama.head_dim_setting("Gemma 3's is 256 (1B: 4 heads on 1152)")
  rope_local_theta: float = setting(
      10000.0, "RoPE's base in the local (sliding-window) layers, unscaled; rope_theta and the "
      "rope_* scaling are the global layers'", MODEL)
  sliding_window_pattern: int = setting(
      6, "Every this many-th layer is global (full attention), the others local (sliding "
      "window): Gemma 3's 5 local : 1 global; 1: all global. Unless layer_types says", MODEL)
  layer_types: str = setting(
      "", "Each layer's kind, a letter a layer: L local (sliding window), G global, e.g. "
      "'LLG'; \"\": from sliding_window_pattern", MODEL)
  query_pre_attn_scalar: int = setting(
      256, "Attention scores are scaled by this ** -0.5 (not head_dim's)", MODEL)
  final_logit_softcapping: float = setting(
      0.0, "> 0: the logits are c * tanh(logits / c) for this c; 0: none", MODEL)
  has_sliding_window = True
  qk_norm = "head"

  def __post_init__(self):
    super().__post_init__()
    if self.qkv_bias:
      raise UserError("config.model.qkv_bias: Gemma 3 has no query, key or value biases")
    llama.resolve_head_dim(self)
    if self.rope_type not in GLOBAL_ROPE_TYPES:
      raise UserError(f"config.model.rope_type {self.rope_type!r}: Gemma 3's global layers take "
                      f"{' or '.join(GLOBAL_ROPE_TYPES)}")
    if self.sliding_window_pattern < 1:
      raise UserError(f"config.model.sliding_window_pattern must be >= 1 (1: every layer "
                      f"global); got {self.sliding_window_pattern}")
    if self.layer_types and (len(self.layer_types) != self.num_layers
                             or set(self.layer_types) - set("LG")):
      raise UserError(f"config.model.layer_types must be {self.num_layers} letters (num_layers), "
                      f"each L (local) or G (global), or \"\"; got {self.layer_types!r}")
    if self.layer_types == _pattern_kinds(self.sliding_window_pattern, self.num_layers):
      object.__setattr__(self, "layer_types", "")  # The pattern's: one spelling, compared equal.
    if not all(self.global_layers) and self.sliding_window <= 0:
      raise UserError("config.model.sliding_window must be positive: Gemma 3's local layers "
                      "attend within it")
    for key in ("query_pre_attn_scalar", "rope_local_theta"):
      if not getattr(self, key) > 0:  # Its square root divides.
        raise UserError(f"config.model.{key} must be positive; got {getattr(self, key)}")
    if self.final_logit_softcapping < 0:
      raise UserError(f"config.model.final_logit_softcapping must be >= 0 (0: none); got "
                      f"{self.final_logit_softcapping}")
    if self.final_logit_softcapping and self.compute.cross_entropy_block_size:
      raise UserError("config.model.final_logit_softcapping is not built with "
                      "config.model.compute.cross_entropy_block_size > 0 (the blockwise loss "
                      "never forms the logits to cap); set it to 0")

  @property
  def global_layers(self) -> tuple[bool, ...]:
    """Each layer's kind: True global (full attention), False local (sliding window)."""
    kinds = self.layer_types or _pattern_kinds(self.sliding_window_pattern, self.num_layers)
    return tuple(kind == "G" for kind in kinds)


def _pattern_kinds(pattern: int, num_layers: int) -> str:
  """The layer kinds (L local, G global) of every pattern-th layer global, as transformers'
  sliding_window_pattern."""
  return "".join("G" if (i + 1) % pattern == 0 else "L" for i in range(num_layers))


class RMSNorm(nn.Module):
  """Gemma's RMSNorm: in float32, x / rms(x) * (1 + scale), the scale initialised to 0."""
  epsilon: float
  dtype: Any
  param_dtype: Any

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scale = self.param("scale", nn.initializers.zeros, (x.shape[-1],), self.param_dtype)
    x = x.astype(jnp.float32)
    normed = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.epsilon)
    return (normed * (1 + scale.astype(jnp.float32))).astype(self.dtype)


def _rms_norm(cfg: Gemma3Config, name: str) -> RMSNorm:
  return RMSNorm(cfg.rms_norm_epsilon, cfg.compute.dtype, cfg.compute.param_dtype, name=name)


def local_rope_frequencies(cfg: Gemma3Config) -> np.ndarray:
  """The local layers' RoPE rates: rope_local_theta^(-2i/head_dim), unscaled."""
  half = cfg.head_dim // 2
  return (cfg.rope_local_theta ** (-np.arange(half, dtype=np.float64) / half)).astype(np.float32)


class Attention(nn.Module):
  config: Gemma3Config
  decode: bool = False

  @nn.compact
  def __call__(self, x: jax.Array, is_global: bool | jax.Array, positions: jax.Array,
               token_mask: jax.Array | None = None,
               segment_ids: jax.Array | None = None,
               logits_at: jax.Array | None = None) -> jax.Array:
    cfg = self.config
    batch, length, _ = x.shape
    q = llama._dense(cfg.num_heads * cfg.head_dim, cfg, "q_proj")(x)
    k, v = (llama._dense(cfg.num_kv_heads * cfg.head_dim, cfg, name)(x)
            for name in ("k_proj", "v_proj"))
    q = q.reshape(batch, length, cfg.num_heads, cfg.head_dim)
    k, v = (t.reshape(batch, length, cfg.num_kv_heads, cfg.head_dim) for t in (k, v))
    q, k = _rms_norm(cfg, "q_norm")(q), _rms_norm(cfg, "k_norm")(k)
    global_rates, local_rates = llama.rope_frequencies(cfg), local_rope_frequencies(cfg)
    if isinstance(is_global, bool):
      frequencies = global_rates if is_global else local_rates
    else:  # A scanned layer's kind, traced.
      frequencies = jnp.where(is_global, global_rates, local_rates)
    q = rotary_and_scale(q, positions, frequencies, cfg)
    q = constrain(q, "batch", "length", "heads", None)
    k = constrain(llama.rotary_embedding(k, positions, frequencies), "batch", "length", "heads",
                  None)
    v = constrain(v, "batch", "length", "heads", None)
    windowed = not is_global if isinstance(is_global, bool) else ~is_global
    out = causal_attention(self, q, k, v, implementation=attention_implementation(cfg),
                           splash_blocks=cfg.compute.splash_blocks,
                           decode=self.decode, token_mask=token_mask, window=cfg.sliding_window,
                           windowed=windowed, segment_ids=segment_ids,
                           cache_dtype=cache_dtype(cfg.compute))
    return llama._dense(cfg.hidden_dim, cfg, "o_proj")(
        out.reshape(batch, length, cfg.num_heads * cfg.head_dim))


def rotary_and_scale(q: jax.Array, positions: jax.Array, frequencies, cfg: Gemma3Config):
  """Queries turned by RoPE and scaled so that every attention kernel's head_dim ** -0.5 makes
  the product query_pre_attn_scalar ** -0.5 (no scaling where they are equal, as in Gemma 3)."""
  q = llama.rotary_embedding(q, positions, frequencies)
  if cfg.query_pre_attn_scalar == cfg.head_dim:
    return q
  return q * jnp.asarray(math.sqrt(cfg.head_dim / cfg.query_pre_attn_scalar), q.dtype)


class MLP(nn.Module):
  """GeGLU: down(gelu_tanh(gate(x)) * up(x))."""
  config: Gemma3Config

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    gate = llama._dense(cfg.intermediate_dim, cfg, "gate_proj")(x)
    up = llama._dense(cfg.intermediate_dim, cfg, "up_proj")(x)
    return llama._dense(cfg.hidden_dim, cfg, "down_proj")(
        constrain(nn.gelu(gate, approximate=True) * up, "batch", "length", "mlp"))


class DecoderLayer(nn.Module):
  config: Gemma3Config
  decode: bool = False

  @nn.compact
  def __call__(self, x: jax.Array, positions_and_masks: tuple,
               is_global: bool | jax.Array) -> jax.Array:
    cfg = self.config
    attended = Attention(cfg, self.decode, name="self_attn")(
        _rms_norm(cfg, "input_layernorm")(x), is_global, *positions_and_masks)
    x = x + _rms_norm(cfg, "post_attention_layernorm")(attended)
    fed = MLP(cfg, name="mlp")(_rms_norm(cfg, "pre_feedforward_layernorm")(x))
    x = x + _rms_norm(cfg, "post_feedforward_layernorm")(fed)
    return constrain(x, "batch", "length", "embed")


class Gemma3ForCausalLM(nn.Module):
  """Maps tokens [batch, length] to next-token logits [batch, length, vocab]; the arguments are
  llama.LlamaForCausalLM's (return_hidden, decode on a KV cache, positions, token_mask,
  segment_ids for document masking)."""
  config: Gemma3Config
  decode: bool = False

  @nn.compact
  def __call__(self, tokens: jax.Array, return_hidden: bool = False,
               positions: jax.Array | None = None,
               token_mask: jax.Array | None = None,
               segment_ids: jax.Array | None = None,
               logits_at: jax.Array | None = None) -> jax.Array:
    cfg = self.config
    embed = nn.Embed(cfg.vocab_size, cfg.hidden_dim, dtype=cfg.compute.dtype,
                     param_dtype=cfg.compute.param_dtype,
                     embedding_init=nn.initializers.normal(cfg.initializer_range),
                     name="embed_tokens")
    # transformers casts sqrt(hidden) to the weights' dtype before it multiplies (bfloat16:
    # sqrt(1152) = 33.94 becomes 34.0).
    x = embed(tokens) * jnp.asarray(math.sqrt(cfg.hidden_dim), cfg.compute.dtype)
    x = constrain(x, "batch", "length", "embed")
    if positions is None:
      positions = (jnp.arange(tokens.shape[1])[None] if segment_ids is None
                   else document_positions(segment_ids))
    x = stack_layers(DecoderLayer, cfg, self.decode, "layers", x,
                     (positions, token_mask, segment_ids), per_layer=cfg.global_layers)
    x = _rms_norm(cfg, "norm")(x)
    if logits_at is not None:  # Only these positions' logits [batch, n]: decoding's last tokens.
      x = jnp.take_along_axis(x, logits_at[..., None], axis=1)
    if return_hidden:
      return x
    logits = embed.attend(x) if cfg.tie_word_embeddings else llama._dense(
        cfg.vocab_size, cfg, "lm_head", layer=False)(x)
    if cfg.final_logit_softcapping:
      cap = jnp.asarray(cfg.final_logit_softcapping, logits.dtype)
      logits = jnp.tanh(logits / cap) * cap
    return constrain(logits, "batch", "length", "vocab")

  output_embedding = staticmethod(llama.LlamaForCausalLM.output_embedding)


# Hugging Face's Gemma3ForCausalLM (config.json's model_type gemma3_text). Linear weights are
# [out, in]: transposed. RMSNorm weights are the w of (1 + w), as ours.


def config_from_hf(hf: dict) -> Gemma3Config:
  hf_keys.refuse_unless(hf, "Gemma 3", {"attention_bias": False,
                                        "hidden_activation": "gelu_pytorch_tanh",
                                        "attn_logit_softcapping": None})
  if hf.get("use_bidirectional_attention"):
    raise UserError(f"Gemma 3 config use_bidirectional_attention="
                    f"{hf['use_bidirectional_attention']!r} is not supported (only false)")
  num_layers = hf_keys.integer(hf, "num_hidden_layers")
  kinds = _layer_types_from_hf(hf, num_layers)
  # The RoPE keys are read below, per layer kind; tied is Gemma's default.
  fields = llama.llama_fields_from_hf(
      {**hf, "rope_scaling": None, "rope_parameters": None,
       "tie_word_embeddings": hf.get("tie_word_embeddings", True)}, head_dim=HF_HEAD_DIM)
  global_rope, local_theta = _rope_from_hf(hf)
  # The layers as a pattern where one gives them (config.json's first; more than num_layers: all
  # local), else letter by letter.
  pattern = hf_keys.integer(hf, "sliding_window_pattern", HF_PATTERN)
  pattern = next((p for p in (pattern, *range(1, num_layers + 2))
                  if _pattern_kinds(p, num_layers) == kinds), pattern)
  softcap = hf.get("final_logit_softcapping")
  return Gemma3Config(
      **(fields | global_rope), rope_local_theta=local_theta,
      sliding_window=hf_keys.integer(hf, "sliding_window", 0),
      sliding_window_pattern=pattern, layer_types=kinds,
      query_pre_attn_scalar=hf_keys.integer(hf, "query_pre_attn_scalar", 256),
      final_logit_softcapping=0.0 if softcap is None else hf_keys.number(
          hf, "final_logit_softcapping"))


def _layer_types_from_hf(hf: dict, num_layers: int) -> str | None:
  """layer_types as our letters (the sliding_window_pattern's where config.json has none)."""
  types = hf.get("layer_types")
  if types is None:
    return _pattern_kinds(hf_keys.integer(hf, "sliding_window_pattern", HF_PATTERN), num_layers)
  if not isinstance(types, list) or len(types) != num_layers:
    raise UserError(f"Gemma 3 config layer_types must be a list of num_hidden_layers "
                    f"({num_layers}) layer kinds; got {types!r}")
  for i, kind in enumerate(types):
    if kind not in (LOCAL, GLOBAL):
      raise UserError(f"Gemma 3 config layer_types[{i}]={kind!r} is not supported (only "
                      f"{LOCAL!r} and {GLOBAL!r})")
  return "".join("G" if kind == GLOBAL else "L" for kind in types)


def _rope_from_hf(hf: dict) -> tuple[dict, float]:
  """(the global layers' rope_* fields, the local layers' base), read as transformers 5 reads
  them: rope_parameters per layer kind, a rope_scaling (4.x) merged into the global one's, and
  rope_theta and rope_local_base_freq (4.x) where those have no rope_theta."""
  parameters = hf.get("rope_parameters") or {}
  if not isinstance(parameters, dict):
    raise UserError(f"Gemma 3 config rope_parameters must be an object, got {parameters!r}")
  kinds = {}
  for kind in (GLOBAL, LOCAL):
    rope = parameters.get(kind) or {"rope_type": "default"}
    if not isinstance(rope, dict):
      raise UserError(f"Gemma 3 config rope_parameters.{kind} must be an object, got {rope!r}")
    kinds[kind] = dict(rope)
  scaling = hf.get("rope_scaling")
  if scaling:
    if not isinstance(scaling, dict):
      raise UserError(f"Gemma 3 config rope_scaling must be an object, got {scaling!r}")
    kinds[GLOBAL].update(scaling)
  kinds[GLOBAL].setdefault("rope_theta", hf_keys.number(hf, "rope_theta", 1_000_000.0))
  kinds[LOCAL].setdefault("rope_theta", hf_keys.number(hf, "rope_local_base_freq", 10_000.0))
  for kind, rope in kinds.items():
    where = f"rope_parameters.{kind}."
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor")) or 1.0
    if partial != 1:
      raise UserError(f"Gemma 3 config partial_rotary_factor={partial!r} is not supported "
                      f"(only 1.0)")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    allowed = GLOBAL_ROPE_TYPES if kind == GLOBAL else ("default",)
    if rope_type not in allowed:
      raise UserError(f"Gemma 3 config {where}rope_type={rope_type!r} is not supported (only "
                      f"{', '.join(allowed)})")
  rope = kinds[GLOBAL]
  theta = hf_keys.number(rope, "rope_theta", where=f"rope_parameters.{GLOBAL}.")
  global_rope = {"rope_theta": theta}
  if rope.get("rope_type", rope.get("type", "default")) == "linear":
    global_rope |= {"rope_type": "linear", "rope_factor": hf_keys.number(
        rope, "factor", where=f"rope_parameters.{GLOBAL}.")}
  return global_rope, hf_keys.number(kinds[LOCAL], "rope_theta",
                                     where=f"rope_parameters.{LOCAL}.")


def config_to_hf(cfg: Gemma3Config) -> dict:
  fields = llama.llama_fields_to_hf(cfg)
  for key in ("hidden_act", "rope_theta", "rope_scaling", "rope_parameters"):
    fields.pop(key, None)
  global_rope = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
  scaling = None
  if cfg.rope_type == "linear":
    scaling = {"rope_type": "linear", "factor": cfg.rope_factor}
    global_rope["factor"] = cfg.rope_factor
  return {**fields, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
          "head_dim": cfg.head_dim, "hidden_activation": "gelu_pytorch_tanh",
          "attention_bias": False, "query_pre_attn_scalar": cfg.query_pre_attn_scalar,
          "sliding_window": cfg.sliding_window,
          "sliding_window_pattern": cfg.sliding_window_pattern,
          "layer_types": [GLOBAL if g else LOCAL for g in cfg.global_layers],
          "final_logit_softcapping": cfg.final_logit_softcapping or None,
          "attn_logit_softcapping": None, "use_bidirectional_attention": False,
          "rope_parameters": {GLOBAL: global_rope,
                              LOCAL: {"rope_type": "default", "rope_theta": cfg.rope_local_theta}},
          # transformers 4.x's spelling of the same.
          "rope_theta": cfg.rope_theta, "rope_local_base_freq": cfg.rope_local_theta,
          "rope_scaling": scaling}


def hf_tensor_names(cfg: Gemma3Config) -> dict[str, tuple[str, bool]]:
  names = {"embed_tokens/embedding": ("model.embed_tokens.weight", False),
           "norm/scale": ("model.norm.weight", False)}
  if not cfg.tie_word_embeddings:
    names["lm_head/kernel"] = ("lm_head.weight", True)
  for i in range(cfg.num_layers):
    prefix = f"model.layers.{i}"
    for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"):
      names[f"layers_{i}/{norm}/scale"] = (f"{prefix}.{norm}.weight", False)
    for part in ("q_proj", "k_proj", "v_proj", "o_proj"):
      names[f"layers_{i}/self_attn/{part}/kernel"] = (f"{prefix}.self_attn.{part}.weight", True)
    for norm in ("q_norm", "k_norm"):
      names[f"layers_{i}/self_attn/{norm}/scale"] = (f"{prefix}.self_attn.{norm}.weight", False)
    for part in ("gate_proj", "up_proj", "down_proj"):
      names[f"layers_{i}/mlp/{part}/kernel"] = (f"{prefix}.mlp.{part}.weight", True)
  return names


FAMILY = ModelFamily(
    name="gemma3", config=Gemma3Config, module=Gemma3ForCausalLM,
    partition_rules=PARTITION_RULES, layer_stack="layers", lookup_tables=llama.lookup_tables,
    hf=HFLayout("Gemma3ForCausalLM", config_from_hf, config_to_hf, hf_tensor_names))
