"""Mixtral: Mistral with a sparse mixture of experts in place of each MLP.

A router (`mlp/gate`, no bias) scores num_experts SwiGLU experts per token;
the token goes to its num_experts_per_token best, weighted by their softmax
probabilities renormalised over those chosen (as transformers' Mixtral).

Dispatch is dropless: every token reaches its experts, whatever the load.
Within each sequence, token copies are sorted by expert and each expert
multiplies its contiguous group in one grouped matmul (`ragged_dot_general`,
one row of group sizes per sequence), then the copies are put back in order
and summed with their weights. A capacity-based dispatch would drop the
overflow of popular experts, so training would compute a different function
than transformers (and inference) does, and its capacity factor would be one
more knob to tune; sorting costs a gather and a permutation of
num_experts_per_token x tokens rows. Sorting per sequence rather than over the
whole batch keeps the layer data-parallel: each device sorts and multiplies
its own sequences, where one global sort would gather every token to every
device. With expert weights split over `sharding.expert_axis` (logical axis
`experts`), each device computes its own experts' groups and the outputs are
summed over that axis. On TPU and GPU the grouped matmul does the work of the
routed experts only; XLA's CPU backend computes it as a masked dense matmul
over every expert.

Each layer's router adds the Switch Transformer load-balancing loss,
num_experts * sum_e(fraction of routed token copies to e * mean probability
of e), sown into the "losses" collection: the step logs its mean over layers
as train/router_aux_loss and adds it times router_aux_loss_coef to the loss.
"""
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from levanter_flax.core.errors import UserError
from levanter_flax.models import hf_keys, llama, mistral
from levanter_flax.models.common import constrain
from levanter_flax.models.family import HFLayout, ModelFamily
from levanter_flax.core.schema import MODEL, STATE, overridden, setting

# Each expert stack's logical axes: its partition rule, and its layout inside the layer.
EXPERT_AXES = {"gate_proj": ("experts", "embed", "mlp"), "up_proj": ("experts", "embed", "mlp"),
               "down_proj": ("experts", "mlp", "embed")}
PARTITION_RULES = (
    (r"mlp/gate/kernel$", ("embed", None)),  # The router: small, whole on every device.
    (r"mlp/experts/(gate_proj|up_proj)$", EXPERT_AXES["gate_proj"]),
    (r"mlp/experts/down_proj$", EXPERT_AXES["down_proj"]),
) + llama.PARTITION_RULES


@dataclasses.dataclass(frozen=True)
class MixtralConfig(mistral.MistralConfig):
  architecture: str = overridden(llama.LlamaConfig, "architecture", "mixtral")
  sliding_window: int = overridden(llama.LlamaConfig, "sliding_window", 0)  # 8x7B, 8x22B: none.
  rope_theta: float = overridden(llama.LlamaConfig, "rope_theta", 1_000_000.0)
  num_experts: int = setting(8, "Experts per layer (HF's num_local_experts)", STATE)
  num_experts_per_token: int = setting(2, "Experts each token is routed to (HF's "
                                       "num_experts_per_tok)", MODEL)
  router_aux_loss_coef: float = setting(0.001, "The load-balancing loss's weight in the "
                                        "training loss (HF's key and default)")

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


# ragged_dot_general's mode 1: rows [sequences, copies, hidden] ragged along the copies,
# weights [experts, hidden, out], group sizes [sequences, experts].
_GROUPED_BY_SEQUENCE = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([2], [1]), ([], [])), lhs_ragged_dimensions=[1],
    rhs_group_dimensions=[0])


class Experts(nn.Module):
  """num_experts SwiGLU MLPs, their weights stacked on a leading expert axis."""
  config: MixtralConfig

  @nn.compact
  def __call__(self, rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """rows [sequences, copies, hidden], each sequence's sorted by expert; group_sizes
    [sequences, num_experts] rows each."""
    cfg = self.config
    init = nn.initializers.normal(cfg.initializer_range)
    wide = (cfg.num_experts, cfg.hidden_dim, cfg.intermediate_dim)
    # Each weight as its rule lays it out, less any ZeRO-3 split: XLA would otherwise keep the
    # weight split and gather the batch's rows instead, every group's, to every device.
    shapes = {"gate_proj": wide, "up_proj": wide, "down_proj": wide[:1] + wide[:0:-1]}
    gate, up, down = (constrain(self.param(name, init, shape, cfg.compute.param_dtype), *EXPERT_AXES[name])
                      for name, shape in shapes.items())
    matmul = lambda x, w: jax.lax.ragged_dot_general(
        x, w.astype(cfg.compute.dtype), group_sizes, _GROUPED_BY_SEQUENCE)
    return matmul(nn.silu(matmul(rows, gate)) * matmul(rows, up), down)


class SparseMoeBlock(nn.Module):
  config: MixtralConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    k = cfg.num_experts_per_token
    router_logits = llama._dense(cfg.num_experts, cfg, "gate")(x)
    probabilities = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    # lax.top_k's partitioner gathers the whole batch to every device; a sort keeps it split.
    experts = jnp.argsort(-probabilities, axis=-1, stable=True)[..., :k]  # [batch, length, k]
    top = jnp.take_along_axis(probabilities, experts, axis=-1)
    weights = (top / top.sum(axis=-1, keepdims=True)).astype(cfg.compute.dtype)
    self.sow("losses", "router_aux_loss", load_balancing_loss(probabilities, experts))
    # Each sequence's length * k token copies, grouped by expert; `order` lists copies
    # (position * k + slot).
    experts = experts.reshape(x.shape[0], -1)
    order = jnp.argsort(experts, axis=-1, stable=True)
    group_sizes = constrain(jax.nn.one_hot(experts, cfg.num_experts, dtype=jnp.int32).sum(axis=1),
                            "batch", None)
    rows = jnp.take_along_axis(x, order[..., None] // k, axis=1)
    outputs = Experts(cfg, name="experts")(rows, group_sizes)
    outputs = jnp.take_along_axis(outputs, jnp.argsort(order, axis=-1)[..., None], axis=1)
    mixed = jnp.einsum("blkd,blk->bld", outputs.reshape(*weights.shape, -1), weights)
    return constrain(mixed, "batch", "length", "embed")


def load_balancing_loss(probabilities: jax.Array, experts: jax.Array) -> jax.Array:
  """Switch Transformer's: num_experts * sum over experts of (the fraction of routed copies
  it gets) * (its mean router probability); num_experts_per_token when both are uniform.
  Per layer, then averaged over layers; transformers concatenates the layers' router outputs
  first, which differs when layers route differently. Not linear in the batch: gradient
  accumulation averages the microbatches'."""
  num_experts = probabilities.shape[-1]
  routed = jax.nn.one_hot(experts, num_experts).mean(axis=(0, 1))  # [k, experts]
  return num_experts * jnp.sum(routed * probabilities.mean(axis=(0, 1)))


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
