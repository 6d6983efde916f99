"""DeepSeek-V3: multi-head latent attention, and a mixture of many narrow experts with shared
experts after a few dense layers, routed by sigmoid scores within groups and balanced by a bias.

Multi-head latent attention (MLA, `LatentAttention`): each token's keys and values are made
from one compressed latent, kv_lora_rank wide (`kv_a_proj_with_mqa`, then RMSNorm), expanded
per head by `kv_b_proj` into a key of qk_nope_head_dim and a value of v_head_dim; RoPE turns a
separate qk_rope_head_dim part of each query and one such key part shared by the heads. Queries
come through a low-rank bottleneck too (q_a_proj, q_a_layernorm, q_b_proj), or a plain q_proj
when q_lora_rank is 0 (DeepSeek-V2-Lite). Scores are scaled by (qk_nope + qk_rope) ** -0.5.
DeepSeek's RoPE turns interleaved pairs (x0, x1), (x2, x3), ... (rope_interleave, HF's default):
they are de-interleaved before the half-split rotation, as transformers does, which leaves
every query-key product as it is.

Decoding caches only the latent and the shared RoPE key (kv_lora_rank + qk_rope_head_dim a
token, 576 in DeepSeek-V3, against 2 x 128 x 128 for its heads' keys and values), and attends
in the latent space: kv_b_proj's key half is absorbed into each query and its value half
applied after the weighted sum, so the cache is never expanded.

The first first_dense_layers layers have a dense SwiGLU MLP of intermediate_dim; the rest a
moe.MoeBlock of experts of moe.expert_dim with num_shared_experts shared ones, routed as
config.model.moe says (sigmoid scoring, num_groups, top_groups, routed_scaling_factor, the
balancing bias). Scanned, the two kinds are two stacks, `dense_layers` and `layers`; unrolled,
layers_<i> whatever their kind, numbered as Hugging Face's DeepseekV3ForCausalLM numbers them.
Its multi-token-prediction layers (num_nextn_predict_layers) are refused; its YaRN RoPE
(llama.py) scales the scores too, by mscale_all_dim's term squared.
"""
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from levanter_flax.core.errors import UserError
from levanter_flax.core.schema import MODEL, STATE, overridden, setting
from levanter_flax.models import common, hf_keys, llama, lora, moe
from levanter_flax.models.attention import append_to_cache, causal_attention
from levanter_flax.models.common import attention_implementation, constrain, stack_layers
from levanter_flax.models.family import HFLayout, ModelFamily
from levanter_flax.models.moe import MoeConfig, moe_section

# The bottlenecks' down-projections are whole along their narrow side; their up-projections
# split by head, as Llama's q_proj.
PARTITION_RULES = moe.PARTITION_RULES + (
    (r"self_attn/(q_a_proj|kv_a_proj_with_mqa)/kernel$", ("embed", None)),
    (r"self_attn/(q_a_layernorm|kv_a_layernorm)/scale$", (None,)),
    (r"self_attn/(q_b_proj|kv_b_proj)/kernel$", (None, "heads")),
) + llama.PARTITION_RULES
# transformers' DeepseekV3RMSNorm default, which its latent norms keep whatever rms_norm_eps.
LATENT_NORM_EPSILON = 1e-6


@dataclasses.dataclass(frozen=True)
class DeepseekV3Config(llama.LlamaConfig):
  architecture: str = overridden(llama.LlamaConfig, "architecture", "deepseek_v3")
  rms_norm_epsilon: float = overridden(llama.LlamaConfig, "rms_norm_epsilon", 1e-6)
  q_lora_rank: int = setting(1536, "Queries' low-rank bottleneck (q_a_proj, q_b_proj); 0: a "
                             "full-rank q_proj (DeepSeek-V2-Lite)", STATE, kw_only=True)
  kv_lora_rank: int = setting(512, "The compressed latent each token's keys and values are made "
                              "from, and all the KV cache keeps of them", STATE, kw_only=True)
  qk_nope_head_dim: int = setting(128, "Each head's query and key width without RoPE",
                                  STATE, kw_only=True)
  qk_rope_head_dim: int = setting(64, "Each head's query and key width turned by RoPE (the key "
                                  "part shared by the heads)", STATE, kw_only=True)
  v_head_dim: int = setting(128, "Each head's value width", STATE, kw_only=True)
  rope_interleave: bool = setting(True, "RoPE turns interleaved pairs (x0, x1), (x2, x3), ... "
                                  "(DeepSeek's), not halves", MODEL, kw_only=True)
  first_dense_layers: int = setting(3, "Layers with a dense MLP of intermediate_dim before the "
                                    "mixtures (HF's first_k_dense_replace)", STATE, kw_only=True)
  moe: MoeConfig = moe_section(
      num_experts=256, num_experts_per_token=8, scoring="sigmoid", num_groups=8, top_groups=4,
      routed_scaling_factor=2.5, bias_update_rate=0.001, expert_dim=2048, num_shared_experts=1,
      router_aux_loss_coef=0.0001)

  def __post_init__(self):
    super().__post_init__()
    common.check_config(self, ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                               "v_head_dim"))
    if self.num_kv_heads != self.num_heads:
      raise UserError(f"config.model.num_kv_heads ({self.num_kv_heads}) must equal "
                      f"config.model.num_heads ({self.num_heads}): latent attention expands a "
                      f"key and a value for every head")
    if self.qk_rope_head_dim % 2:
      raise UserError(f"config.model.qk_rope_head_dim must be even (RoPE turns pairs); got "
                      f"{self.qk_rope_head_dim}")
    if self.q_lora_rank < 0:
      raise UserError(f"config.model.q_lora_rank must be >= 0 (0: none); got {self.q_lora_rank}")
    if not 0 <= self.first_dense_layers <= self.num_layers:
      raise UserError(f"config.model.first_dense_layers must be between 0 and "
                      f"config.model.num_layers ({self.num_layers}); got "
                      f"{self.first_dense_layers}")
    if self.moe.scoring != "sigmoid":
      raise UserError("config.model.moe.scoring must be 'sigmoid' for deepseek_v3, as "
                      "transformers' DeepseekV3TopkRouter scores")

  @property
  def head_dim(self) -> int:
    """The FLOPs count's head width: the mean of a query-key head's and a value head's (scores
    take the one, the weighted sum the other)."""
    return (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim) // 2

  @property
  def attention_scale(self) -> float:
    """(qk_nope + qk_rope) ** -0.5, times YaRN's mscale squared (llama.yarn_score_scale)."""
    return (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5 * llama.yarn_score_scale(self)


def _rotated(cfg: DeepseekV3Config, x: jax.Array, positions: jax.Array) -> jax.Array:
  """x [..., qk_rope_head_dim] turned by RoPE, de-interleaved first when cfg.rope_interleave."""
  if cfg.rope_interleave:
    x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
  return llama.rotary_embedding(x, positions, llama.rope_frequencies(cfg, cfg.qk_rope_head_dim),
                                llama.rope_attention_factor(cfg))


def _latent_norm(cfg: DeepseekV3Config, name: str) -> nn.RMSNorm:
  return nn.RMSNorm(epsilon=LATENT_NORM_EPSILON, dtype=cfg.compute.dtype,
                    param_dtype=cfg.compute.param_dtype, name=name)


class LatentAttention(nn.Module):
  config: DeepseekV3Config
  decode: bool = False

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array, token_mask: jax.Array | None = None,
               segment_ids: jax.Array | None = None) -> jax.Array:
    cfg = self.config
    batch, length, _ = x.shape
    heads, nope = cfg.num_heads, cfg.qk_nope_head_dim
    dense = lambda features, name: llama._dense(features, cfg, name)
    if cfg.q_lora_rank:
      q = dense(heads * (nope + cfg.qk_rope_head_dim), "q_b_proj")(
          _latent_norm(cfg, "q_a_layernorm")(dense(cfg.q_lora_rank, "q_a_proj")(x)))
    else:
      q = dense(heads * (nope + cfg.qk_rope_head_dim), "q_proj")(x)
    q = q.reshape(batch, length, heads, -1)
    q_nope, q_rope = q[..., :nope], _rotated(cfg, q[..., nope:], positions)
    compressed = dense(cfg.kv_lora_rank + cfg.qk_rope_head_dim, "kv_a_proj_with_mqa")(x)
    latent = _latent_norm(cfg, "kv_a_layernorm")(compressed[..., :cfg.kv_lora_rank])
    k_rope = _rotated(cfg, compressed[:, :, None, cfg.kv_lora_rank:], positions)[:, :, 0]
    expand = dense(heads * (nope + cfg.v_head_dim), "kv_b_proj")
    if self.decode:
      out = self._attend_cached(q_nope, q_rope, latent, k_rope, expand, token_mask)
    else:
      kv = expand(latent).reshape(batch, length, heads, -1)
      k = jnp.concatenate([kv[..., :nope], jnp.broadcast_to(
          k_rope[:, :, None], (batch, length, heads, cfg.qk_rope_head_dim))], axis=-1)
      q = constrain(jnp.concatenate([q_nope, q_rope], axis=-1), "batch", "length", "heads", None)
      k = constrain(k, "batch", "length", "heads", None)
      v = constrain(kv[..., nope:], "batch", "length", "heads", None)
      out = causal_attention(self, q, k, v, implementation=attention_implementation(cfg),
                             splash_blocks=cfg.compute.splash_blocks,
                             segment_ids=segment_ids, scale=cfg.attention_scale)
    return dense(cfg.hidden_dim, "o_proj")(out.reshape(batch, length, heads * cfg.v_head_dim))

  def _attend_cached(self, q_nope, q_rope, latent, k_rope, expand: lora.Dense, token_mask):
    """Attention on the cache of latents and RoPE keys, in the latent space: q_nope [batch,
    length, heads, nope] through kv_b_proj's key half scores against the latents themselves,
    and the weighted latents go through its value half. Returns [batch, length, heads, v]."""
    cfg = self.config
    cache, mask = append_to_cache(self, {"latents": latent, "rope_keys": k_rope}, token_mask,
                                  dtype=common.cache_dtype(cfg.compute))
    if cache is None:  # model.init with a cache-sized input: shapes only (and kv_b_proj's params).
      expand(latent)
      return jnp.zeros((*q_nope.shape[:3], cfg.v_head_dim), q_nope.dtype)
    kernel = lora.effective_kernel(expand).reshape(cfg.kv_lora_rank, cfg.num_heads, -1)
    key_half, value_half = kernel[..., :cfg.qk_nope_head_dim], kernel[..., cfg.qk_nope_head_dim:]
    f32 = lambda a: a.astype(jnp.float32)
    scores = (jnp.einsum("blhn,rhn,bsr->bhls", f32(q_nope), f32(key_half), f32(cache["latents"]))
              + jnp.einsum("blhd,bsd->bhls", f32(q_rope), f32(cache["rope_keys"])))
    # Finite, as jax.nn's attention masks.
    weights = jax.nn.softmax(jnp.where(mask, scores * cfg.attention_scale,
                                       jnp.finfo(jnp.float32).min), axis=-1)
    out = jnp.einsum("bhls,bsr,rhv->blhv", weights, f32(cache["latents"]), f32(value_half))
    return out.astype(q_nope.dtype)


class DenseLayer(llama.DecoderLayer):
  attention = LatentAttention


class MoeBlock(moe.MoeBlock):
  shared_mlp = llama.MLP


class MoeLayer(DenseLayer):
  feed_forward = MoeBlock


class DeepseekV3ForCausalLM(llama.LlamaForCausalLM):
  def blocks(self, x: jax.Array, positions_and_masks: tuple) -> jax.Array:
    cfg = self.config
    for layer, (name, layers) in zip((DenseLayer, MoeLayer), layer_stacks(cfg)):
      x = stack_layers(layer, cfg, self.decode, name, x, positions_and_masks, layers=layers,
                       unrolled_name="layers")
    return x


def layer_stacks(cfg: DeepseekV3Config) -> tuple[tuple[str, range], ...]:
  return (("dense_layers", range(cfg.first_dense_layers)),
          ("layers", range(cfg.first_dense_layers, cfg.num_layers)))


# Hugging Face's DeepseekV3ForCausalLM, as save_pretrained writes it (transformers 5): each
# expert's gate_proj, up_proj and down_proj Linear apart, under mlp.experts.<e>; the balancing
# bias as mlp.gate.e_score_correction_bias.
HF_REFUSED = {"hidden_act": "silu", "attention_bias": False, "num_nextn_predict_layers": 0,
              "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}


def config_from_hf(hf: dict) -> DeepseekV3Config:
  hf_keys.refuse_unless(hf, "DeepSeek-V3", HF_REFUSED)
  experts = hf_keys.integer(hf, "n_routed_experts", None) or hf_keys.integer(
      hf, "num_local_experts")
  groups = hf_keys.integer(hf, "n_group", 1)
  if experts % groups:
    raise UserError(f"DeepSeek-V3 config n_group={groups} must divide n_routed_experts={experts}")
  first_dense = hf.get("first_k_dense_replace", 0)
  if isinstance(first_dense, bool) or not isinstance(first_dense, int) or first_dense < 0:
    raise UserError(f"first_k_dense_replace must be an integer >= 0, got {first_dense!r}")
  # head_dim is the RoPE part's width there (transformers sets it so), not hidden_size / heads.
  fields = llama.llama_fields_from_hf({key: value for key, value in hf.items()
                                       if key != "head_dim"})
  return DeepseekV3Config(
      **fields, q_lora_rank=hf_keys.integer(hf, "q_lora_rank", 0),
      kv_lora_rank=hf_keys.integer(hf, "kv_lora_rank"),
      qk_nope_head_dim=hf_keys.integer(hf, "qk_nope_head_dim"),
      qk_rope_head_dim=hf_keys.integer(hf, "qk_rope_head_dim"),
      v_head_dim=hf_keys.integer(hf, "v_head_dim"),
      rope_interleave=hf_keys.boolean(hf, "rope_interleave", True),
      first_dense_layers=first_dense,
      moe=MoeConfig(
          num_experts=experts, num_experts_per_token=hf_keys.integer(hf, "num_experts_per_tok"),
          normalize_top_k=hf_keys.boolean(hf, "norm_topk_prob", True), scoring="sigmoid",
          num_groups=groups, top_groups=hf_keys.integer(hf, "topk_group", 1),
          routed_scaling_factor=hf_keys.number(hf, "routed_scaling_factor", 1.0),
          expert_dim=hf_keys.integer(hf, "moe_intermediate_size"),
          num_shared_experts=hf_keys.integer(hf, "n_shared_experts", 1),
          bias_update_rate=0.001, router_aux_loss_coef=0.0001))


def config_to_hf(cfg: DeepseekV3Config) -> dict:
  return {**llama.llama_fields_to_hf(cfg), "architectures": ["DeepseekV3ForCausalLM"],
          "model_type": "deepseek_v3", **{key: value for key, value in HF_REFUSED.items()
                                          if key in ("attention_bias", "num_nextn_predict_layers")},
          "q_lora_rank": cfg.q_lora_rank or None, "kv_lora_rank": cfg.kv_lora_rank,
          "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
          "head_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim,
          "rope_interleave": cfg.rope_interleave, "first_k_dense_replace": cfg.first_dense_layers,
          "moe_intermediate_size": cfg.moe.expert_dim, "n_routed_experts": cfg.moe.num_experts,
          "num_experts_per_tok": cfg.moe.num_experts_per_token, "n_group": cfg.moe.num_groups,
          "topk_group": cfg.moe.top_groups, "norm_topk_prob": cfg.moe.normalize_top_k,
          "routed_scaling_factor": cfg.moe.routed_scaling_factor,
          "n_shared_experts": cfg.moe.num_shared_experts}


def hf_tensor_names(cfg: DeepseekV3Config) -> dict:
  names = {ours: theirs for ours, theirs in llama.hf_tensor_names(cfg).items()
           if not ours.startswith("layers_") or "/mlp/" in ours or "layernorm" in ours}
  attention = (["q_a_proj", "q_b_proj"] if cfg.q_lora_rank else ["q_proj"]) + [
      "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
  for i in range(cfg.num_layers):
    ours, theirs = f"layers_{i}/self_attn", f"model.layers.{i}.self_attn"
    names |= {f"{ours}/{part}/kernel": (f"{theirs}.{part}.weight", True) for part in attention}
    norms = (["q_a_layernorm"] if cfg.q_lora_rank else []) + ["kv_a_layernorm"]
    names |= {f"{ours}/{norm}/scale": (f"{theirs}.{norm}.weight", False) for norm in norms}
  return moe.hf_tensor_names(cfg, names, "mlp", {name: name for name in moe.EXPERT_AXES},
                             layers=range(cfg.first_dense_layers, cfg.num_layers))


FAMILY = ModelFamily(
    name="deepseek_v3", config=DeepseekV3Config, module=DeepseekV3ForCausalLM,
    partition_rules=PARTITION_RULES, layer_stack="layers", lookup_tables=llama.lookup_tables,
    hf=HFLayout("DeepseekV3ForCausalLM", config_from_hf, config_to_hf, hf_tensor_names),
    inactive_params=moe.inactive_params, layer_stacks=layer_stacks)
