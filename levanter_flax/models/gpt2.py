"""GPT-2 in Flax Linen, laid out like OpenAI's so its weights map one to one.

Learned positions, pre-LayerNorm blocks, tanh-approximated GELU, biases
everywhere, input/output embeddings tied (or, with tie_word_embeddings=False, a
separate bias-free `lm_head` as in HF's untied GPT-2), and GPT-2's initialisation: N(0, 0.02)
with the residual projections scaled by 1/sqrt(2 * num_layers). Parameter names
follow the Hugging Face checkpoint (wte, wpe, h_<i>/attn/c_attn, ...), which is
also what the partition rules match; with scan_layers the blocks' parameters
are stacked under `h` instead, and the same rules apply to their trailing axes.
"""
import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from levanter_flax.core.errors import UserError
from levanter_flax.models import hf_keys, int8, lora
from levanter_flax.models.lora import LoraConfig
from levanter_flax.models.attention import causal_attention, document_positions
from levanter_flax.models.common import (ComputeConfig, attention_implementation, cache_dtype,
                                         check_config, compute_section, constrain, stack_layers)
from levanter_flax.models.family import HFLayout, ModelFamily
from levanter_flax.core.schema import MODEL, STATE, setting


# Megatron-style tensor parallelism, in logical axes (sharding.tensor_axis takes heads,
# mlp and vocab): QKV and MLP-in are split by output column, attention-out and MLP-out
# by input row, so each block needs one all-reduce per matmul pair; embeddings and an
# untied head are split by vocabulary. LayerNorms, position embeddings and the row-split
# layers' biases (added after the all-reduce) are not split. Every parameter has a rule,
# so config.sharding.strict can be on.
PARTITION_RULES = (
    (r"wte/embedding$", ("vocab", "embed")),
    (r"attn/c_attn/kernel$", ("embed", "heads")),
    (r"attn/c_attn/bias$", ("heads",)),
    (r"attn/c_proj/kernel$", ("heads", "embed")),
    (r"mlp/c_fc/kernel$", ("embed", "mlp")),
    (r"mlp/c_fc/bias$", ("mlp",)),
    (r"mlp/c_proj/kernel$", ("mlp", "embed")),
    (r"lm_head/kernel$", ("embed", "vocab")),  # Only with tie_word_embeddings=False.
    (r"(attn|mlp)/c_proj/bias$", ("embed",)),
    (r"wpe/embedding$", ("length", "embed")),
    (r"(ln_1|ln_2|ln_f)/(scale|bias)$", ("embed",)),
)


@dataclasses.dataclass(frozen=True)
class GPT2Config:
  """GPT-2 small (124M) by default: the default config's model."""
  vocab_size: int = setting(50257, "Must cover the tokenizer's vocabulary (GPT-2's: 50257)", STATE)
  # The position table has seq_len rows: a longer context is another state.
  seq_len: int = setting(1024, "Tokens per training window", STATE)
  num_layers: int = setting(12, "Transformer blocks", STATE)
  num_heads: int = setting(12, "Attention heads; they divide hidden_dim", STATE)
  hidden_dim: int = setting(768, "Width of the residual stream", STATE)
  architecture: str = setting("gpt2", "The model family, a key of models.FAMILIES; "
                              "config.model = model_config(<family>, ...) sets the rest", STATE)
  layer_norm_epsilon: float = setting(1e-5, "LayerNorm's epsilon", MODEL)
  initializer_range: float = setting(0.02, "Standard deviation of the initial weights")
  tie_word_embeddings: bool = setting(
      True, "The LM head is the token embedding (GPT-2's way); False: a separate lm_head matrix, "
      "as in HF checkpoints with tie_word_embeddings=false", STATE)
  compute: ComputeConfig = compute_section()
  lora: LoraConfig = lora.lora_section()

  def __post_init__(self):
    check_config(self, ("vocab_size", "seq_len", "num_layers", "num_heads", "hidden_dim"))

  @property
  def head_dim(self) -> int:
    return self.hidden_dim // self.num_heads


def _dense(features: int, cfg: GPT2Config, name: str, std: float) -> lora.Dense:
  return lora.Dense(features, dtype=cfg.compute.dtype, param_dtype=cfg.compute.param_dtype,
                    kernel_init=nn.initializers.normal(std), bias_init=nn.initializers.zeros,
                    dot_general=int8.layer_dot_general(cfg.compute), lora=cfg.lora, name=name)


def _layer_norm(cfg: GPT2Config, name: str) -> nn.LayerNorm:
  return nn.LayerNorm(epsilon=cfg.layer_norm_epsilon, dtype=cfg.compute.dtype,
                      param_dtype=cfg.compute.param_dtype, name=name)


def _residual_std(cfg: GPT2Config) -> float:
  # GPT-2 scales the layers that write into the residual stream so its
  # variance does not grow with depth.
  return cfg.initializer_range / math.sqrt(2 * cfg.num_layers)


class CausalSelfAttention(nn.Module):
  config: GPT2Config
  decode: bool = False

  @nn.compact
  def __call__(self, x: jax.Array, token_mask: jax.Array | None = None,
               segment_ids: jax.Array | None = None) -> jax.Array:
    cfg = self.config
    batch, length, _ = x.shape
    qkv = _dense(3 * cfg.hidden_dim, cfg, "c_attn", cfg.initializer_range)(x)
    # Split on the width, whose thirds are whole lane tiles, before shaping the heads: split
    # on a [.., 3, heads, head_dim] view, a TPU copied the projection into another layout.
    q, k, v = (constrain(t.reshape(batch, length, cfg.num_heads, cfg.head_dim),
                         "batch", "length", "heads", None) for t in jnp.split(qkv, 3, axis=-1))
    out = causal_attention(self, q, k, v, implementation=attention_implementation(cfg),
                           splash_blocks=cfg.compute.splash_blocks,
                           decode=self.decode, token_mask=token_mask, segment_ids=segment_ids,
                           cache_dtype=cache_dtype(cfg.compute))
    out = out.reshape(batch, length, cfg.hidden_dim)
    return _dense(cfg.hidden_dim, cfg, "c_proj", _residual_std(cfg))(out)


class MLP(nn.Module):
  config: GPT2Config

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    x = _dense(4 * cfg.hidden_dim, cfg, "c_fc", cfg.initializer_range)(x)
    x = constrain(nn.gelu(x, approximate=True), "batch", "length", "mlp")
    return _dense(cfg.hidden_dim, cfg, "c_proj", _residual_std(cfg))(x)


class Block(nn.Module):
  config: GPT2Config
  decode: bool = False

  @nn.compact
  def __call__(self, x: jax.Array, masks: tuple) -> jax.Array:
    x = x + CausalSelfAttention(self.config, self.decode, name="attn")(
        _layer_norm(self.config, "ln_1")(x), *masks)
    x = x + MLP(self.config, name="mlp")(_layer_norm(self.config, "ln_2")(x))
    return constrain(x, "batch", "length", "embed")


class GPT2LMHeadModel(nn.Module):
  """Maps tokens [batch, length] to next-token logits [batch, length, vocab].

  With return_hidden it stops before the LM head and returns the final hidden
  states [batch, length, hidden_dim], for a loss that applies
  `output_embedding` itself, a block of the vocabulary at a time. With decode=True it
  runs on a KV cache (see attention.py); positions [batch, length] and token_mask then place
  each row at its own position (generate/engine.py's slots), and logits_at [batch, n] keeps
  only those positions' logits. With segment_ids [batch, length] (document masking),
  attention stays within each segment and positions restart at each.
  """
  config: GPT2Config
  decode: bool = False

  @nn.compact
  def __call__(self, tokens: jax.Array, return_hidden: bool = False,
               positions: jax.Array | None = None,
               token_mask: jax.Array | None = None,
               segment_ids: jax.Array | None = None,
               logits_at: jax.Array | None = None) -> jax.Array:
    cfg = self.config
    embed_init = nn.initializers.normal(cfg.initializer_range)
    wte = nn.Embed(cfg.vocab_size, cfg.hidden_dim, embedding_init=embed_init,
                   dtype=cfg.compute.dtype, param_dtype=cfg.compute.param_dtype, name="wte")
    wpe = nn.Embed(cfg.seq_len, cfg.hidden_dim, embedding_init=embed_init,
                   dtype=cfg.compute.dtype, param_dtype=cfg.compute.param_dtype, name="wpe")
    if positions is None:
      positions = (jnp.arange(tokens.shape[1])[None] if segment_ids is None
                   else document_positions(segment_ids))
    x = constrain(wte(tokens) + wpe(positions), "batch", "length", "embed")
    x = stack_layers(Block, cfg, self.decode, "h", x, (token_mask, segment_ids))
    x = _layer_norm(cfg, "ln_f")(x)
    if logits_at is not None:  # Only these positions' logits [batch, n]: decoding's last tokens.
      x = jnp.take_along_axis(x, logits_at[..., None], axis=1)
    if return_hidden:
      return x
    if cfg.tie_word_embeddings:
      logits = wte.attend(x)
    else:
      logits = nn.Dense(cfg.vocab_size, use_bias=False, dtype=cfg.compute.dtype,
                        param_dtype=cfg.compute.param_dtype, kernel_init=embed_init, name="lm_head")(x)
    return constrain(logits, "batch", "length", "vocab")

  @staticmethod
  def output_embedding(params) -> jax.Array:
    """The LM head as [vocab, hidden_dim]: the token embedding, unless an untied head exists."""
    # Static (step.py calls it with params alone), so the params say whether the head is tied.
    if "lm_head" in params:
      return params["lm_head"]["kernel"].T
    return params["wte"]["embedding"]


# Hugging Face's GPT2LMHeadModel. Its Conv1D weights are stored [in, out], like our kernels.


def config_from_hf(hf: dict) -> GPT2Config:
  if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
    raise UserError(f"GPT-2 activation_function {hf['activation_function']!r} is not supported "
                    f"(only the tanh GELU, gelu_new)")
  # Values that change the logits and that our GPT-2 does not compute. reorder_and_upcast_attn
  # is fine: it only reorders the scaling and runs attention in float32, the same arithmetic.
  hf_keys.refuse_unless(hf, "GPT-2", {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                              "add_cross_attention": False})
  hidden_dim = hf_keys.integer(hf, "n_embd")
  if hf_keys.integer(hf, "n_inner", 4 * hidden_dim) != 4 * hidden_dim:
    raise UserError(f"GPT-2 config n_inner={hf['n_inner']!r} is not supported (only 4 x n_embd, "
                    f"{4 * hidden_dim}, or null)")
  tied = hf.get("tie_word_embeddings", True)
  if not isinstance(tied, bool):
    raise UserError(f"tie_word_embeddings must be true or false, got {tied!r}")
  return GPT2Config(vocab_size=hf_keys.integer(hf, "vocab_size"), seq_len=hf_keys.integer(hf, "n_positions"),
                    num_layers=hf_keys.integer(hf, "n_layer"), num_heads=hf_keys.integer(hf, "n_head"),
                    hidden_dim=hidden_dim,
                    layer_norm_epsilon=hf_keys.number(hf, "layer_norm_epsilon", 1e-5),
                    initializer_range=hf_keys.number(hf, "initializer_range", 0.02),
                    tie_word_embeddings=tied)


def config_to_hf(cfg: GPT2Config) -> dict:
  return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
          "vocab_size": cfg.vocab_size, "n_positions": cfg.seq_len, "n_embd": cfg.hidden_dim,
          "n_layer": cfg.num_layers, "n_head": cfg.num_heads,
          "layer_norm_epsilon": cfg.layer_norm_epsilon, "activation_function": "gelu_new",
          "initializer_range": cfg.initializer_range,
          "tie_word_embeddings": cfg.tie_word_embeddings,
          "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def hf_tensor_names(cfg: GPT2Config) -> dict[str, tuple[str, bool]]:
  """Our parameter path -> (HF tensor name, transposed?)."""
  names = {"wte/embedding": "transformer.wte.weight", "wpe/embedding": "transformer.wpe.weight",
           "ln_f/scale": "transformer.ln_f.weight", "ln_f/bias": "transformer.ln_f.bias"}
  for i in range(cfg.num_layers):
    for ours, theirs in (("ln_1/scale", "ln_1.weight"), ("ln_1/bias", "ln_1.bias"),
                         ("ln_2/scale", "ln_2.weight"), ("ln_2/bias", "ln_2.bias"),
                         ("attn/c_attn/kernel", "attn.c_attn.weight"),
                         ("attn/c_attn/bias", "attn.c_attn.bias"),
                         ("attn/c_proj/kernel", "attn.c_proj.weight"),
                         ("attn/c_proj/bias", "attn.c_proj.bias"),
                         ("mlp/c_fc/kernel", "mlp.c_fc.weight"), ("mlp/c_fc/bias", "mlp.c_fc.bias"),
                         ("mlp/c_proj/kernel", "mlp.c_proj.weight"),
                         ("mlp/c_proj/bias", "mlp.c_proj.bias")):
      names[f"h_{i}/{ours}"] = f"transformer.h.{i}.{theirs}"
  names = {ours: (theirs, False) for ours, theirs in names.items()}
  if not cfg.tie_word_embeddings:  # A Linear, [vocab, hidden]; our Dense kernel is its transpose.
    names["lm_head/kernel"] = ("lm_head.weight", True)
  return names


def lookup_tables(params: dict) -> tuple[str, ...]:
  """Positions are only looked up; so is the token embedding when an untied head exists
  (tied, it is also the LM head's matmul)."""
  return ("wpe", "wte") if "lm_head" in params else ("wpe",)


FAMILY = ModelFamily(
    name="gpt2", config=GPT2Config, module=GPT2LMHeadModel, partition_rules=PARTITION_RULES,
    layer_stack="h", lookup_tables=lookup_tables,
    hf=HFLayout("GPT2LMHeadModel", config_from_hf, config_to_hf, hf_tensor_names))
