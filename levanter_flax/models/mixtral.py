"""Mixtral: Mistral with a sparse mixture of experts in place of each MLP.

A router (`mlp/gate`, no bias) scores num_experts SwiGLU experts per token;
the token goes to its num_experts_per_token best, weighted by their softmax
probabilities renormalised over those chosen (as transformers' Mixtral).

Dispatch is dropless: every token reaches its experts, whatever the load.
Token copies are sorted by expert and each expert multiplies its contiguous
group in one grouped matmul (`jax.lax.ragged_dot`), then the copies are put
back in order and summed with their weights. A capacity-based dispatch would
drop the overflow of popular experts, so training would compute a different
function than transformers (and inference) does, and its capacity factor
would be one more knob to tune; sorting costs a gather and a permutation of
num_experts_per_token x tokens rows. With expert weights split over
`sharding.expert_axis` (logical axis `experts`), XLA gives each device its own
experts' groups and sums the outputs over that axis. On TPU and GPU the
grouped matmul does the work of the routed experts only; XLA's CPU backend
computes it as a masked dense matmul over every expert.

Each layer's router adds the Switch Transformer load-balancing loss,
num_experts * sum_e(fraction of routed token copies to e * mean probability
of e), sown into the "losses" collection: the step logs its mean over layers
as train/router_aux_loss and adds it times router_aux_loss_coef to the loss.
"""
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from levanter_flax.errors import UserError
from levanter_flax.models import hf_keys, llama, mistral
from levanter_flax.models.common import constrain
from levanter_flax.models.family import HFLayout, ModelFamily

PARTITION_RULES = (
    (r"mlp/gate/kernel$", ("embed", None)),  # The router: small, whole on every device.
    (r"mlp/experts/(gate_proj|up_proj)$", ("experts", "embed", "mlp")),
    (r"mlp/experts/down_proj$", ("experts", "mlp", "embed")),
) + llama.PARTITION_RULES


@dataclasses.dataclass(frozen=True)
class MixtralConfig(mistral.MistralConfig):
  architecture: str = "mixtral"
  sliding_window: int = 0  # Mixtral 8x7B and 8x22B have none.
  rope_theta: float = 1_000_000.0
  num_experts: int = 8  # HF's num_local_experts.
  num_experts_per_token: int = 2  # HF's num_experts_per_tok.
  # The load-balancing loss's weight in the training loss (HF's key and default).
  router_aux_loss_coef: float = 0.001

  def __post_init__(self):
    super().__post_init__()
    if self.num_experts < 1:
      raise UserError(f"config.model.num_experts must be positive, got {self.num_experts}")
    if not 1 <= self.num_experts_per_token <= self.num_experts:
      raise UserError(f"config.model.num_experts_per_token must be between 1 and "
                      f"config.model.num_experts ({self.num_experts}); "
                      f"got {self.num_experts_per_token}")
    if not self.router_aux_loss_coef >= 0:
      raise UserError(f"config.model.router_aux_loss_coef must be >= 0, "
                      f"got {self.router_aux_loss_coef}")


class Experts(nn.Module):
  """num_experts SwiGLU MLPs, their weights stacked on a leading expert axis."""
  config: MixtralConfig

  @nn.compact
  def __call__(self, rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """rows [n, hidden], sorted by expert; group_sizes [num_experts] rows each."""
    cfg = self.config
    init = nn.initializers.normal(cfg.initializer_range)
    wide = (cfg.num_experts, cfg.hidden_dim, cfg.intermediate_dim)
    gate, up = (self.param(name, init, wide, cfg.param_dtype) for name in ("gate_proj", "up_proj"))
    down = self.param("down_proj", init, wide[:1] + wide[:0:-1], cfg.param_dtype)
    matmul = lambda x, w: jax.lax.ragged_dot(x, w.astype(cfg.dtype), group_sizes)
    return matmul(nn.silu(matmul(rows, gate)) * matmul(rows, up), down)


class SparseMoeBlock(nn.Module):
  config: MixtralConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    batch, length, hidden = x.shape
    tokens = x.reshape(-1, hidden)
    router_logits = llama._dense(cfg.num_experts, cfg, "gate")(tokens)
    probabilities = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    top, experts = jax.lax.top_k(probabilities, cfg.num_experts_per_token)  # [tokens, k]
    weights = (top / top.sum(axis=-1, keepdims=True)).astype(cfg.dtype)
    self.sow("losses", "router_aux_loss", load_balancing_loss(probabilities, experts))
    # Each token's k copies, grouped by expert; `order` lists copies (token * k + slot).
    order = jnp.argsort(experts.reshape(-1), stable=True)
    group_sizes = jnp.bincount(experts.reshape(-1), length=cfg.num_experts).astype(jnp.int32)
    outputs = Experts(cfg, name="experts")(tokens[order // cfg.num_experts_per_token], group_sizes)
    outputs = outputs[jnp.argsort(order)].reshape(*experts.shape, hidden)  # Back in token order.
    mixed = jnp.einsum("tkd,tk->td", outputs, weights)
    return constrain(mixed.reshape(batch, length, hidden), "batch", "length", "embed")


def load_balancing_loss(probabilities: jax.Array, experts: jax.Array) -> jax.Array:
  """Switch Transformer's: num_experts * sum over experts of (the fraction of routed copies
  it gets) * (its mean router probability); num_experts_per_token when both are uniform.
  Per layer, then averaged over layers; transformers concatenates the layers' router outputs
  first, which differs when layers route differently. Not linear in the batch: gradient
  accumulation averages the microbatches'."""
  num_experts = probabilities.shape[-1]
  routed = jax.nn.one_hot(experts, num_experts).mean(axis=0)  # [k, experts]
  return num_experts * jnp.sum(routed * probabilities.mean(axis=0))


class DecoderLayer(llama.DecoderLayer):
  feed_forward = SparseMoeBlock


class MixtralForCausalLM(llama.LlamaForCausalLM):
  decoder_layer = DecoderLayer


def inactive_params(cfg: MixtralConfig, params: dict) -> float:
  """The experts a token is not routed to: (1 - k / num_experts) of the expert weights."""
  expert_params = sum(x.size for path, x in jax.tree_util.tree_leaves_with_path(params)
                      if "experts" in jax.tree_util.keystr(path))
  return expert_params * (1 - cfg.num_experts_per_token / cfg.num_experts)


# Hugging Face's MixtralForCausalLM, as save_pretrained writes it (transformers 4 and 5): each
# expert's w1 (gate), w3 (up) and w2 (down) Linear apart, under block_sparse_moe.


def config_from_hf(hf: dict) -> MixtralConfig:
  hf_keys.refuse_unless(hf, "Mixtral", {"hidden_act": "silu", "router_jitter_noise": 0.0,
                                        "tie_word_embeddings": False})
  return MixtralConfig(**llama.llama_fields_from_hf(hf),
                       sliding_window=hf_keys.integer(hf, "sliding_window", 0),
                       num_experts=hf_keys.integer(hf, "num_local_experts"),
                       num_experts_per_token=hf_keys.integer(hf, "num_experts_per_tok"),
                       router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)))


def config_to_hf(cfg: MixtralConfig) -> dict:
  return {**llama.llama_fields_to_hf(cfg), "architectures": ["MixtralForCausalLM"],
          "model_type": "mixtral", "sliding_window": cfg.sliding_window or None,
          "num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_token,
          "router_aux_loss_coef": cfg.router_aux_loss_coef, "router_jitter_noise": 0.0}


def hf_tensor_names(cfg: MixtralConfig) -> dict:
  """Llama's names, with each MLP's three matrices as the stacks of their experts'."""
  names = {ours: theirs for ours, theirs in llama.hf_tensor_names(cfg).items()
           if "/mlp/" not in ours}
  for i in range(cfg.num_layers):
    prefix = f"model.layers.{i}.block_sparse_moe"
    names[f"layers_{i}/mlp/gate/kernel"] = (f"{prefix}.gate.weight", True)
    for ours, theirs in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
      names[f"layers_{i}/mlp/experts/{ours}"] = (
          tuple(f"{prefix}.experts.{e}.{theirs}.weight" for e in range(cfg.num_experts)), True)
  return names


FAMILY = ModelFamily(
    name="mixtral", config=MixtralConfig, module=MixtralForCausalLM,
    partition_rules=PARTITION_RULES, layer_stack="layers", lookup_tables=llama.lookup_tables,
    hf=HFLayout("MixtralForCausalLM", config_from_hf, config_to_hf, hf_tensor_names),
    inactive_params=inactive_params)
