"""Mixtures of experts: the config section (config.model.moe), routing, and the routed experts
computed as one grouped matmul over each device's tokens, sent to their experts' devices.

May import core and the models package's common, int8 and lora; the families with experts
(mixtral, qwen3_moe) build their feed-forward block from `MoeBlock`.

Routing is data-parallel, as any layer: the router (`mlp/gate`, no bias) scores each token,
which goes to its num_experts_per_token best experts (`route`). With softmax scoring (Mixtral,
Qwen3-MoE) they are weighted by their probabilities, renormalised over those chosen with
normalize_top_k. With sigmoid scoring (DeepSeek-V3) each expert's score is a sigmoid, and the
choice is group-limited: the experts fall in num_groups groups, a token may only choose among
the top_groups groups whose two best scores sum highest, and it chooses by score plus a
per-expert bias (`mlp/e_score_correction_bias`) that moves each step towards an even load,
outside the gradient (auxiliary-loss-free balancing: `updated_biases`); the weights are the
scores without the bias, times routed_scaling_factor. A layer may add shared experts: one
SwiGLU MLP of num_shared_experts experts' width that every token goes through.

The experts run inside `jax.shard_map` over the mesh in context, on each device's own tokens
(`_layout` says which axes split what):
1. Its tokens flattened to [T, hidden], their T x k copies sorted by expert
   (`_copies_through_experts`). With a capacity factor, an expert keeps at most
   ceil(factor x T x k / experts) of a device's copies and the rest are dropped: they add
   nothing, and are counted.
2. With experts split over an expert axis, each device sends each copy to its expert's device
   and gets the results back: `jax.lax.ragged_all_to_all`, whose bytes grow with
   tokens x k x hidden, whatever the expert count (`_exchange`). Tokens that the expert axis
   does not split (the batch on "data" only) are split over it on the way in, and gathered
   back on the way out.
3. Each device multiplies its experts' contiguous groups in one grouped matmul
   (`jax.lax.ragged_dot`, no batch dimension; or Pallas megablox `gmm`; under int8 training,
   `int8.grouped_matmul`). Under ZeRO-3 the
   weights come in split as the partitioner stores them (their largest free dimension:
   Mixtral's expert width, Qwen3-MoE's model width) and are gathered there, in the compute
   dtype, so that their gradients leave reduce-scattered. With the width split over a tensor
   axis, the partial outputs are summed over it.
4. Each copy's output, weighted, is added to its token's row.

Dropless by default: every token reaches its experts whatever the load, so training computes
the function transformers (and inference) do. XLA:CPU has no ragged all-to-all; there the
exchange pads each block to the whole operand and uses a dense all_to_all, with the same
result (`_ragged_all_to_all`).

Each layer sows into "losses" the Switch Transformer load-balancing loss and the router z-loss
(ST-MoE: mean of logsumexp(router logits)^2); the step weighs them by `loss_coefficients`.
It sows into "router" what the step logs: each layer's busiest expert's load over the mean
load, the router's entropy, and the fraction of token copies dropped; a sigmoid router also
sows its copies per expert into BALANCE, for the balancing biases' update.
"""
import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import megablox
from jax.sharding import PartitionSpec as P

from levanter_flax.core.errors import UserError
from levanter_flax.core.schema import FREE, MODEL, STATE, setting
from levanter_flax.models import int8, lora, pipeline
from levanter_flax.models.common import (BALANCE, cast_in_layer, constrain,
                                         platform_in_context)

SCORINGS = ("softmax", "sigmoid")
BIAS = "e_score_correction_bias"  # Sigmoid routing's balancing bias, HF's name for it.
# BALANCE (common's): the collection a sigmoid router sows each layer's copies per expert into
# ("expert_load"), the step's for the balancing biases' update, not a metric. The loss's parts
# carry them under this name too, by the path of their MoeBlock ("layers/mlp").
# Each expert stack's logical axes: its partition rule, and its layout inside the layer.
EXPERT_AXES = {"gate_proj": ("experts", "embed", "mlp"), "up_proj": ("experts", "embed", "mlp"),
               "down_proj": ("experts", "mlp", "embed")}
PARTITION_RULES = (
    (r"mlp/gate/kernel$", ("embed", None)),  # The router: small, whole on every device.
    (rf"mlp/{BIAS}$", (None,)),
    (r"mlp/shared_experts/(gate_proj|up_proj)/kernel$", ("embed", "mlp")),
    (r"mlp/shared_experts/down_proj/kernel$", ("mlp", "embed")),
    (r"mlp/experts/(gate_proj|up_proj)$", EXPERT_AXES["gate_proj"]),
    (r"mlp/experts/down_proj$", EXPERT_AXES["down_proj"]),
)
DROPLESS = "dropless"
GROUPED_MATMULS = ("auto", "ragged_dot", "gmm")
# Megablox gmm's row tile: it multiplies whole tiles, so the rows are padded to a multiple.
GMM_ROW_TILE = 128


def _capacity_factor(key: str, value: Any) -> float | str:
  if value == DROPLESS:
    return value
  try:
    factor = float(value)
  except (TypeError, ValueError):
    factor = math.nan
  if not factor > 0:
    raise UserError(f"config key {key} must be {DROPLESS!r} or a number > 0 (each expert keeps "
                    f"at most that times its even share of a device's tokens); got {value!r}")
  return factor


@dataclasses.dataclass(frozen=True)
class MoeConfig:
  """A mixture of experts' routing and dispatch (config.model.moe)."""
  num_experts: int = setting(8, "Experts per layer (HF's num_local_experts)", STATE)
  num_experts_per_token: int = setting(2, "Experts each token is routed to (HF's "
                                       "num_experts_per_tok)", MODEL)
  normalize_top_k: bool = setting(True, "Rescale the chosen experts' router probabilities to "
                                  "sum to 1 (Mixtral always; Qwen3-MoE's norm_topk_prob)", MODEL)
  capacity_factor: float | str = setting(
      DROPLESS, "dropless: every token reaches its experts; a number > 0: each expert keeps at "
      "most that times its even share of a device's token copies and drops the rest "
      "(train/router/dropped_fraction)", FREE, convert=_capacity_factor)
  grouped_matmul: str = setting(
      "auto", "The experts' grouped matmul: ragged_dot (jax.lax.ragged_dot, any device), gmm "
      "(Pallas megablox, TPU; interpreted elsewhere, slowly), or auto: gmm on a TPU, else "
      "ragged_dot")
  router_aux_loss_coef: float = setting(0.001, "The load-balancing loss's weight in the "
                                        "training loss (HF's router_aux_loss_coef)")
  router_z_loss_coef: float = setting(0.0, "The router z-loss's weight (ST-MoE: the mean of "
                                      "logsumexp(router logits)^2); 0: off")
  scoring: str = setting("softmax", "The router's scores: softmax (Mixtral, Qwen3-MoE) or "
                         "sigmoid (DeepSeek-V3: with a balancing bias, bias_update_rate)", STATE)
  num_groups: int = setting(1, "Sigmoid routing: the experts fall in this many equal groups "
                            "(HF's n_group); it must divide num_experts", MODEL)
  top_groups: int = setting(1, "Sigmoid routing: a token chooses among the experts of this "
                            "many groups, those whose two best scores sum highest (HF's "
                            "topk_group)", MODEL)
  routed_scaling_factor: float = setting(1.0, "The routed experts' weights are scaled by this "
                                         "(DeepSeek-V3: 2.5)", MODEL)
  bias_update_rate: float = setting(
      0.0, "Sigmoid routing: each step, each expert's bias moves by this towards an even load "
      "(+ when under the mean load, - when over; DeepSeek-V3's gamma, 0.001); 0: fixed")
  expert_dim: int = setting(0, "Each routed expert's width; 0: config.model.intermediate_dim "
                            "(DeepSeek-V3's dense layers are wider: HF's moe_intermediate_size)",
                            STATE)
  num_shared_experts: int = setting(0, "Experts every token goes through besides its routed "
                                    "ones, as one MLP of that many experts' width (DeepSeek's "
                                    "n_shared_experts)", STATE)

  def __post_init__(self):
    if self.num_experts < 1:
      raise UserError(f"config.model.moe.num_experts must be positive, got {self.num_experts}")
    if not 1 <= self.num_experts_per_token <= self.num_experts:
      raise UserError(f"config.model.moe.num_experts_per_token must be between 1 and "
                      f"config.model.moe.num_experts ({self.num_experts}); "
                      f"got {self.num_experts_per_token}")
    if self.grouped_matmul not in GROUPED_MATMULS:
      raise UserError(f"config.model.moe.grouped_matmul must be one of "
                      f"{', '.join(GROUPED_MATMULS)}; got {self.grouped_matmul!r}")
    for key in ("router_aux_loss_coef", "router_z_loss_coef", "bias_update_rate",
                "expert_dim", "num_shared_experts"):
      if not getattr(self, key) >= 0:
        raise UserError(f"config.model.moe.{key} must be >= 0, got {getattr(self, key)}")
    if self.scoring not in SCORINGS:
      raise UserError(f"config.model.moe.scoring must be one of {', '.join(SCORINGS)}; "
                      f"got {self.scoring!r}")
    self._check_groups()

  def _check_groups(self):
    if self.scoring == "softmax":
      for key in ("num_groups", "top_groups", "bias_update_rate"):
        if getattr(self, key) != MoeConfig.__dataclass_fields__[key].default:
          raise UserError(f"config.model.moe.{key} needs config.model.moe.scoring='sigmoid'")
      return
    if self.num_groups < 1 or self.num_experts % self.num_groups:
      raise UserError(f"config.model.moe.num_groups ({self.num_groups}) must divide "
                      f"config.model.moe.num_experts ({self.num_experts})")
    per_group = self.num_experts // self.num_groups
    if not 1 <= self.top_groups <= self.num_groups:
      raise UserError(f"config.model.moe.top_groups must be between 1 and "
                      f"config.model.moe.num_groups ({self.num_groups}); got {self.top_groups}")
    if self.num_experts_per_token > self.top_groups * per_group:
      raise UserError(f"config.model.moe.num_experts_per_token ({self.num_experts_per_token}) "
                      f"exceeds the experts of config.model.moe.top_groups ({self.top_groups}) "
                      f"groups of {per_group}")

  @property
  def dropless(self) -> bool:
    return self.capacity_factor == DROPLESS


def moe_section(**defaults) -> Any:
  """The `moe` field of a family with experts, with the family's own defaults."""
  return setting(MoeConfig(**defaults), "The mixture of experts: routing and dispatch",
                 kw_only=True)


def grouped_matmul(cfg: MoeConfig) -> str:
  """cfg.grouped_matmul for the platform in context. On TPU, megablox skips the tiles past the
  groups (a dropless inbox's padding), and the compiler plans mixtral.py:8x7b in less memory
  with it (Performance Guide)."""
  if cfg.grouped_matmul != "auto":
    return cfg.grouped_matmul
  return "gmm" if platform_in_context() == "tpu" else "ragged_dot"


def section_of(cfg) -> "MoeConfig | None":
  """A model config's mixture section; None for a dense family's."""
  return getattr(cfg, "moe", None)


def loss_coefficients(cfg) -> dict[str, float]:
  """The weight in the training loss of each auxiliary loss a model config's layers sow."""
  moe = section_of(cfg)
  return {} if moe is None else {"router_aux_loss": moe.router_aux_loss_coef,
                                 "router_z_loss": moe.router_z_loss_coef}


def bias_update_rate(cfg) -> float:
  """How far a model config's balancing biases move a step (0: no mixture, or fixed)."""
  moe = section_of(cfg)
  return 0.0 if moe is None else moe.bias_update_rate


def check_expert_axis(cfg: MoeConfig, expert_axis_size: int) -> None:
  """An expert axis must split the experts evenly."""
  if cfg.num_experts % expert_axis_size:
    raise UserError(f"config.model.moe.num_experts ({cfg.num_experts}) must be divisible by the "
                    f"expert axis's size ({expert_axis_size}: sharding.expert_axis on "
                    f"trainer.device_mesh)")


def inactive_params(cfg, params: dict) -> float:
  """The expert weights a token is not routed to: (1 - k / num_experts) of the stacks."""
  expert_params = sum(x.size for path, x in jax.tree_util.tree_leaves_with_path(params)
                      if any(getattr(key, "key", None) == "experts" for key in path))
  return expert_params * (1 - cfg.moe.num_experts_per_token / cfg.moe.num_experts)


def hf_tensor_names(cfg, dense_names: dict[str, tuple], block: str,
                    projections: dict[str, str], layers: range | None = None
                    ) -> dict[str, tuple]:
  """A dense family's names (`dense_names`: path -> (HF tensor name, transposed?)) with the MLP
  of each of `layers` (by default all) as a router and expert stacks, the experts' Linear
  layers saved apart (transformers 4 and 5 alike), and any balancing bias and shared experts
  (DeepSeek's): `block` the HF feed-forward module (Mixtral's block_sparse_moe), `projections`
  our stacks' names -> theirs."""
  layers = range(cfg.num_layers) if layers is None else layers
  sparse = tuple(f"layers_{i}/mlp/" for i in layers)
  names = {ours: theirs for ours, theirs in dense_names.items() if not ours.startswith(sparse)}
  for i in layers:
    ours, prefix = f"layers_{i}/mlp", f"model.layers.{i}.{block}"
    names[f"{ours}/gate/kernel"] = (f"{prefix}.gate.weight", True)
    for stack, theirs in projections.items():
      names[f"{ours}/experts/{stack}"] = (
          tuple(f"{prefix}.experts.{e}.{theirs}.weight" for e in range(cfg.moe.num_experts)), True)
    if cfg.moe.scoring == "sigmoid":
      names[f"{ours}/{BIAS}"] = (f"{prefix}.gate.{BIAS}", False)
    if cfg.moe.num_shared_experts:
      for part in ("gate_proj", "up_proj", "down_proj"):
        names[f"{ours}/shared_experts/{part}/kernel"] = (
            f"{prefix}.shared_experts.{part}.weight", True)
  return names


def route(cfg: MoeConfig, logits: jax.Array, bias: jax.Array | None = None
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(experts [..., k] int32, their weights [..., k] float32, probabilities [..., experts]:
  the scores normalised to sum to 1, for the balancing loss and the entropy). bias
  [experts]: sigmoid routing's, added to the scores to choose, not to weigh."""
  logits = logits.astype(jnp.float32)
  if cfg.scoring == "softmax":
    scores = choice = jax.nn.softmax(logits, axis=-1)
  else:
    scores = jax.nn.sigmoid(logits)
    choice = _within_top_groups(cfg, scores + bias)
  # lax.top_k's partitioner gathers the whole batch to every device; a sort keeps it split.
  experts = jnp.argsort(-choice, axis=-1, stable=True)[..., :cfg.num_experts_per_token]
  weights = jnp.take_along_axis(scores, experts, axis=-1)
  if cfg.normalize_top_k:
    weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
  probabilities = scores / scores.sum(axis=-1, keepdims=True)
  return experts.astype(jnp.int32), weights * cfg.routed_scaling_factor, probabilities


def _within_top_groups(cfg: MoeConfig, choice: jax.Array) -> jax.Array:
  """choice [..., experts] with -inf outside each token's top_groups groups, ranked by the sum
  of their two best (DeepSeek-V3's group-limited routing)."""
  if cfg.top_groups == cfg.num_groups:
    return choice
  groups = choice.reshape(*choice.shape[:-1], cfg.num_groups, -1)
  best_two = -jnp.sort(-groups, axis=-1)[..., :2].sum(axis=-1)  # [..., groups]
  rank = jnp.argsort(jnp.argsort(-best_two, axis=-1, stable=True), axis=-1)
  kept = (rank < cfg.top_groups)[..., None]
  return jnp.where(kept, groups, -jnp.inf).reshape(choice.shape)


def updated_biases(params: dict, loads: dict[str, jax.Array], rate: float) -> dict:
  """params with each sigmoid router's bias moved by `rate` towards an even load: up for an
  expert given fewer copies than the mean, down for more (DeepSeek-V3's auxiliary-loss-free
  balancing). loads: the parts' BALANCE, by MoeBlock path, [experts] or a scanned stack's
  [layers, experts]. Outside the gradient: whatever the optimizer did to the bias is replaced."""
  def update(path, value):
    keys = [key.key for key in path]
    if keys[-1] != BIAS:
      return value
    load = loads["/".join(keys[:-1])]
    return value + rate * jnp.sign(load.mean(axis=-1, keepdims=True) - load).astype(value.dtype)
  return jax.tree_util.tree_map_with_path(update, params)


def load_balancing_loss(probabilities: jax.Array, experts: jax.Array) -> jax.Array:
  """Switch Transformer's: num_experts * sum over experts of (the fraction of routed copies
  it gets) * (its mean router probability); num_experts_per_token when both are uniform.
  Per layer, then averaged over layers; transformers concatenates the layers' router outputs
  first, which differs when layers route differently. Not linear in the batch: gradient
  accumulation averages the microbatches'."""
  num_experts = probabilities.shape[-1]
  routed = jax.nn.one_hot(experts, num_experts).mean(axis=(0, 1))  # [k, experts]
  return num_experts * jnp.sum(routed * probabilities.mean(axis=(0, 1)))


class MoeBlock(nn.Module):
  """The feed-forward block of a mixture: a router and num_experts SwiGLU MLPs, their weights
  stacked on a leading expert axis (`experts/gate_proj` [experts, hidden, mlp], ...), and any
  shared experts (`shared_experts`, the family's `shared_mlp` of their width).

  `config`: a family's config with hidden_dim, intermediate_dim, initializer_range, compute,
  lora and moe."""
  config: Any
  shared_mlp = None  # A module class (config, name=...): the family's MLP, for shared experts.

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg, moe = self.config, self.config.moe
    # Pinned, so that the layout the experts' shard_map asks for goes no further back.
    x = constrain(x, "batch", "length", "embed")
    router = lora.Dense(moe.num_experts, use_bias=False, dtype=cfg.compute.dtype,
                        param_dtype=cfg.compute.param_dtype,
                        kernel_init=nn.initializers.normal(cfg.initializer_range),
                        lora=cfg.lora, name="gate")
    logits = router(x).astype(jnp.float32)
    bias = None
    if moe.scoring == "sigmoid":  # Float32 whatever the params' dtype: steps of 0.001 add up.
      bias = jax.lax.stop_gradient(self.param(BIAS, nn.initializers.zeros, (moe.num_experts,),
                                              jnp.float32))
    experts, weights, probabilities = (constrain(a, "batch", "length", None)
                                       for a in route(moe, logits, bias))
    self.sow("losses", "router_aux_loss", load_balancing_loss(probabilities, experts))
    self.sow("losses", "router_z_loss", jnp.square(jax.nn.logsumexp(logits, axis=-1)).mean())
    mixed, dropped = Experts(cfg, name="experts")(x, experts,
                                                  weights.astype(cfg.compute.dtype))
    load = jax.nn.one_hot(experts, moe.num_experts, dtype=jnp.float32).sum(axis=(0, 1, 2))
    self.sow("router", "load_max_over_mean", load.max() / load.mean())
    self.sow("router", "entropy", -jnp.sum(probabilities * jnp.log(probabilities + 1e-30),
                                           axis=-1).mean())
    self.sow("router", "dropped_fraction", dropped / experts.size)
    if bias is not None:
      self.sow(BALANCE, "expert_load", load)
    if moe.num_shared_experts:
      width = expert_width(cfg) * moe.num_shared_experts
      mixed = mixed + self.shared_mlp(dataclasses.replace(cfg, intermediate_dim=width),
                                      name="shared_experts")(x)
    return constrain(mixed, "batch", "length", "embed")


def expert_width(cfg) -> int:
  """A routed expert's width: config.model.moe.expert_dim, or the family's intermediate_dim."""
  return cfg.moe.expert_dim or cfg.intermediate_dim


class Experts(nn.Module):
  """num_experts SwiGLU MLPs applied to the token copies routed to them."""
  config: Any

  @nn.compact
  def __call__(self, x: jax.Array, experts: jax.Array, weights: jax.Array
               ) -> tuple[jax.Array, jax.Array]:
    """x [batch, length, hidden]; experts and weights [batch, length, k]. Returns (the weighted
    sum of each token's experts' outputs, how many copies were dropped, a float32 count)."""
    cfg = self.config
    init = nn.initializers.normal(cfg.initializer_range)
    wide = (cfg.moe.num_experts, cfg.hidden_dim, expert_width(cfg))
    shapes = {"gate_proj": wide, "up_proj": wide, "down_proj": wide[:1] + wide[:0:-1]}
    # With LoRA adapters added, then in the compute dtype: any ZeRO-3 split is gathered in it
    # (routed_experts).
    stacks = [cast_in_layer(lora.with_stack_adapters(self, cfg.lora, name, self.param(
        name, init, shape, cfg.compute.param_dtype)), cfg.compute.dtype)
              for name, shape in shapes.items()]
    return routed_experts(cfg.moe, x, experts, weights, *stacks,
                          int8_products=cfg.compute.quantization == "int8")


@dataclasses.dataclass(frozen=True)
class _Layout:
  """Where a device's part of the expert layer lives on the mesh: the axes splitting the
  tokens, the experts (expert parallelism), and the experts' width (tensor parallelism)."""
  token_axes: tuple[str, ...] = ()
  expert_axes: tuple[str, ...] = ()
  width_axes: tuple[str, ...] = ()
  # Each stack's (gate, up, down) ZeRO-3 axes, which split it as it comes in, and the
  # dimension they split.
  zero3: tuple[tuple[tuple[str, ...], int], ...] = (((), 0),) * 3
  sizes: tuple[tuple[str, int], ...] = ()

  def size(self, axes: tuple[str, ...]) -> int:
    return math.prod(dict(self.sizes)[a] for a in axes)

  @property
  def unsplit_expert_axes(self) -> tuple[str, ...]:
    """Expert axes that do not split the tokens: each of their devices takes a share of them."""
    return tuple(a for a in self.expert_axes if a not in self.token_axes)


def _axes(entry) -> tuple[str, ...]:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def routed_experts(cfg: MoeConfig, x: jax.Array, experts: jax.Array, weights: jax.Array,
                   gate: jax.Array, up: jax.Array, down: jax.Array, *, int8_products: bool = False
                   ) -> tuple[jax.Array, jax.Array]:
  """Experts' computation over the mesh in context (see the module docstring); without a mesh,
  on one device. int8_products: the grouped matmuls through int8 (int8.grouped_matmul)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not nn.get_logical_axis_rules():
    return _on_device(cfg, _Layout(), int8_products, x, experts, weights, gate, up, down)
  layout, token_spec, stack_specs = _layout(dict(mesh.shape), x.shape,
                                            dict(zip(EXPERT_AXES["gate_proj"], gate.shape)))
  routing_spec = P(*token_spec[:2], None)
  # Megablox declares its outputs without the mesh axes they vary over, which only an
  # unchecked shard_map accepts; and jax 0.10 cannot vmap a checked one over a pipeline's
  # stages (spmd_axis_name: its batching rule marks the stage axis varying twice).
  checked = (int8_products or grouped_matmul(cfg) != "gmm") and not pipeline.in_stage()
  on_device = jax.shard_map(
      lambda *args: _on_device(cfg, layout, int8_products, *args),
      out_specs=(P(*token_spec), P()), check_vma=checked,
      in_specs=(P(*token_spec), routing_spec, routing_spec, *stack_specs))
  return on_device(x, experts, weights, gate, up, down)


def _layout(sizes: dict[str, int], shape: tuple[int, ...], stack_shape: dict[str, int]):
  """(_Layout, the tokens' spec, each expert stack's spec) inside the shard_map, from the
  logical axis rules in context; `stack_shape`: each logical axis of the stacks' size. Axes of
  one device split nothing."""
  split = lambda entry: tuple(a for a in _axes(entry) if sizes[a] > 1)
  size = lambda axes: math.prod(sizes[a] for a in axes)
  # A dimension its axes do not divide (init's batch of one) stays whole on each device.
  token_spec = [axes if dim % size(axes) == 0 else () for axes, dim in zip(
      map(split, nn.logical_to_mesh_axes(("batch", "length", "embed"))), shape)]
  expert_axes, embed_axes, width_axes = map(split,
                                            nn.logical_to_mesh_axes(EXPERT_AXES["gate_proj"]))
  # Tokens the expert axis does not split are split over it on the way in: the batch if it
  # divides, else the sequence; else each device takes its share inside (_on_device).
  unsplit = tuple(a for a in expert_axes if a not in token_spec[0] + token_spec[1])
  for dim in (0, 1):
    if unsplit and shape[dim] % size(token_spec[dim] + unsplit) == 0:
      token_spec[dim], unsplit = token_spec[dim] + unsplit, ()
  token_axes = token_spec[0] + token_spec[1]
  if set(width_axes) & set(token_axes):
    raise UserError(f"the experts' width (logical axis mlp: mesh axes {width_axes}) and the "
                    f"tokens (mesh axes {token_axes}) share a mesh axis; give "
                    f"sharding.tensor_axis an axis that does not split the batch")
  placed = {"experts": expert_axes, "embed": embed_axes, "mlp": width_axes}
  stack_specs, zero3_dims = [], []
  for name in ("gate_proj", "up_proj", "down_proj"):
    spec = [placed[axis] for axis in EXPERT_AXES[name]]
    dim, zero3_axes = _zero3_placement(sizes, EXPERT_AXES[name],
                                       tuple(stack_shape[a] for a in EXPERT_AXES[name]))
    # Gathered in the layer: only axes that split the tokens, where each device's gradient
    # differs and the gather's transpose sums them. XLA gathers any other before the layer.
    zero3_axes = tuple(a for a in zero3_axes if a in token_axes)
    if zero3_axes:
      spec[dim] = zero3_axes
    zero3_dims.append((zero3_axes, dim))
    stack_specs.append(P(*(entry or None for entry in spec)))
  layout = _Layout(token_axes=token_axes, expert_axes=expert_axes, width_axes=width_axes,
                   zero3=tuple(zero3_dims), sizes=tuple(sizes.items()))
  return layout, [axes or None for axes in token_spec], stack_specs


def _zero3_placement(sizes: dict[str, int], logical: tuple[str, ...], shape: tuple[int, ...]
                     ) -> tuple[int, tuple[str, ...]]:
  """(the dimension, the mesh axes of one device or more) where ZeRO-3 splits an expert stack
  of these logical axes and shape: where the partitioner puts it (parallel/partitioning.py), the
  largest dimension that no rule claims and the axes it does not use divide, the first of
  equals; else no axes. (A scanned stack's layer dimension is never the largest.)"""
  claimed = [_axes(entry) for entry in nn.logical_to_mesh_axes(logical)]
  zero3 = tuple(a for a in _axes(nn.logical_to_mesh_axes(("zero3",))[0])
                if not any(a in axes for axes in claimed))
  count = math.prod(sizes[a] for a in zero3)
  free = [d for d in range(len(shape)) if not claimed[d] and shape[d] % count == 0]
  if not zero3 or not free:
    return 0, ()
  return max(free, key=lambda d: shape[d]), tuple(a for a in zero3 if sizes[a] > 1)


def _on_device(cfg: MoeConfig, layout: _Layout, int8_products: bool, x, experts, weights, gate,
               up, down):
  """One device's tokens through their experts: (outputs like x, dropped copies, summed over
  the mesh)."""
  shape = x.shape
  x, experts, weights = (a.reshape(-1, a.shape[-1]) for a in (x, experts, weights))
  share_axes = layout.unsplit_expert_axes
  shares = layout.size(share_axes)
  if shares > 1:  # This device's share of tokens the expert axis does not split.
    total = x.shape[0]
    per_share = -(-total // shares)
    padding = per_share * shares - total
    pad = lambda a, value: jnp.pad(a, ((0, padding), (0, 0)), constant_values=value)
    start = jax.lax.axis_index(share_axes) * per_share
    take = lambda a: jax.lax.dynamic_slice_in_dim(a, start, per_share)
    x, weights = take(pad(x, 0)), take(pad(weights, 0))
    experts = take(pad(experts, cfg.num_experts))  # Padding goes to no expert.
  gate, up, down = (jax.lax.all_gather(w, axes, tiled=True, axis=dim) if axes else w
                    for w, (axes, dim) in zip((gate, up, down), layout.zero3))
  outputs, dropped = _copies_through_experts(cfg, layout, int8_products, x, experts, weights,
                                             gate, up, down)
  if shares > 1:
    outputs = jax.lax.all_gather(outputs, share_axes, tiled=True, to="invarying")[:total]
    dropped = jax.lax.psum(dropped, share_axes)
  if layout.token_axes:
    dropped = jax.lax.psum(dropped, layout.token_axes)
  return outputs.reshape(shape), dropped


def _copies_through_experts(cfg: MoeConfig, layout: _Layout, int8_products: bool, x, experts,
                            weights, gate, up, down):
  """x [T, hidden], experts and weights [T, k]: each token's weighted sum of its experts'
  outputs, and the number of copies dropped (float32)."""
  k = experts.shape[-1]
  copies, dropped = _kept_copies(cfg, experts.reshape(-1))
  order = jnp.argsort(copies, stable=True)  # By expert; dropped copies (num_experts) last.
  counts = jnp.bincount(copies, length=cfg.num_experts + 1)[:-1].astype(jnp.int32)
  rows = x[order // k]
  if layout.size(layout.expert_axes) > 1:
    outputs = _exchange(cfg, layout, int8_products, rows, counts, gate, up, down,
                        _inbox_rows(cfg, layout, rows))
  else:
    outputs = _grouped_mlp(cfg, layout, int8_products, rows, counts, gate, up, down)
  # Each sorted copy, weighted, added to its token's row: no unsorted copy of the outputs.
  weighted = outputs * weights.reshape(-1)[order][:, None]
  return jnp.zeros_like(x).at[order // k].add(weighted), dropped


def _kept_copies(cfg: MoeConfig, copies: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Each copy's expert, num_experts where it is dropped, and how many were dropped: over
  capacity, the later copies of an expert's (as they come, token by token)."""
  routed = copies < cfg.num_experts
  if cfg.dropless:
    return copies, jnp.zeros((), jnp.float32)
  capacity = math.ceil(cfg.capacity_factor * copies.size / cfg.num_experts)
  one_hot = jax.nn.one_hot(copies, cfg.num_experts, dtype=jnp.int32)
  position = jnp.sum(jnp.cumsum(one_hot, axis=0) * one_hot, axis=-1) - 1
  kept = routed & (position < capacity)
  return (jnp.where(kept, copies, cfg.num_experts),
          jnp.sum(routed & ~kept).astype(jnp.float32))


def _inbox_rows(cfg: MoeConfig, layout: _Layout, rows: jax.Array) -> int:
  """The rows a device may receive: every copy of the expert group's devices when dropless,
  else its experts' capacity from each of them."""
  devices = layout.size(layout.expert_axes)
  if cfg.dropless:
    return devices * rows.shape[0]
  capacity = math.ceil(cfg.capacity_factor * rows.shape[0] / cfg.num_experts)
  return devices * (cfg.num_experts // devices) * capacity


def _grouped_mlp(cfg: MoeConfig, layout: _Layout, int8_products: bool, rows, group_sizes, gate,
                 up, down):
  """SwiGLU per expert on rows grouped by expert (group_sizes rows each; any rows after them
  give zeros), summed over the axes that split the width. int8 products go through ragged_dot,
  whatever grouped_matmul says: megablox gmm multiplies floats."""
  pad = 0
  if int8_products:
    # A token's copies go to distinct experts: a group holds at most a k-th of the rows.
    int8.check_group_rows(rows.shape[0] // cfg.num_experts_per_token)
    matmul = lambda a, w: int8.grouped_matmul(*_varying_alike(a, w), group_sizes)
  elif grouped_matmul(cfg) == "gmm":
    pad = -rows.shape[0] % GMM_ROW_TILE
    interpret = platform_in_context() != "tpu"
    matmul = lambda a, w: megablox.gmm(a, w, group_sizes, a.dtype, (GMM_ROW_TILE, 128, 128),
                                       None, None, False, interpret)
  else:
    matmul = lambda a, w: jax.lax.ragged_dot(a, w, group_sizes)
  # On a TPU the grouped products leave the rows after the groups (the dropped copies, and
  # gmm's padding) unwritten, forward and back (gmm; ragged_dot's int32 products on a v5e
  # chip): they are zeroed going in (which zeroes their gradient) and out of each product.
  grouped = (jnp.arange(rows.shape[0] + pad) < group_sizes.sum())[:, None]
  padded = jnp.where(grouped, jnp.pad(rows, ((0, pad), (0, 0))), 0)
  outputs = _swiglu(lambda a, w: jnp.where(grouped, matmul(a, w), 0), padded, gate, up,
                    down)[:rows.shape[0]]
  return jax.lax.psum(outputs, layout.width_axes) if layout.width_axes else outputs


def _varying_alike(*arrays: jax.Array) -> list[jax.Array]:
  """`arrays` cast to vary over every mesh axis any of them varies over (inside a shard_map).
  A custom_vjp's gradients must vary as its inputs do; lax's own products get there by their
  transposes' psums, which the casts' transposes are here."""
  varying = lambda a: jax.typeof(a).manual_axis_type.varying
  axes = frozenset().union(*map(varying, arrays))
  return [jax.lax.pcast(a, tuple(sorted(axes - varying(a))), to="varying")
          if axes - varying(a) else a for a in arrays]


def _swiglu(matmul, rows, gate, up, down):
  return matmul(nn.silu(matmul(rows, gate)) * matmul(rows, up), down)


def _exclusive_cumsum(a: jax.Array, axis: int = 0) -> jax.Array:
  return jnp.cumsum(a, axis=axis) - a


def _exchange(cfg: MoeConfig, layout: _Layout, int8_products: bool, rows, counts, gate, up, down,
              inbox_rows: int):
  """Expert parallelism: rows (sorted by expert, counts [num_experts] each) go to their
  experts' devices, through the grouped MLP there, and back in the same order."""
  axes = layout.expert_axes
  devices, local_experts = layout.size(axes), gate.shape[0]
  me = jax.lax.axis_index(axes)
  every_count = jax.lax.all_gather(counts, axes)  # [source device, expert]
  pair = every_count.reshape(devices, devices, local_experts).sum(-1)  # [source, destination]
  sent, received = pair[me], pair[:, me]
  send_offsets = _exclusive_cumsum(sent)
  inbox_offsets = _exclusive_cumsum(received)
  inbox = _ragged_all_to_all(rows, jnp.zeros((inbox_rows, rows.shape[1]), rows.dtype),
                             send_offsets, sent, _exclusive_cumsum(pair)[me], received, axes)
  # The inbox holds each source's rows of this device's experts in expert order: regroup them.
  mine = jax.lax.dynamic_slice_in_dim(every_count, me * local_experts, local_experts, axis=1)
  segment = jnp.searchsorted(jnp.cumsum(mine.reshape(-1)), jnp.arange(inbox_rows), side="right")
  expert = jnp.where(segment < mine.size, segment % local_experts, local_experts)
  regroup = jnp.argsort(expert, stable=True)
  outputs = _grouped_mlp(cfg, layout, int8_products, inbox[regroup], mine.sum(0), gate, up,
                         down)
  # Back in the inbox's order, by a gather: a scatter would start from a zeroed copy.
  outputs = outputs[jnp.argsort(regroup)]
  return _ragged_all_to_all(outputs, jnp.zeros_like(rows), inbox_offsets, received,
                            _exclusive_cumsum(pair, axis=1)[:, me], sent, axes)


def _ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                       axes):
  """jax.lax.ragged_all_to_all, which XLA:CPU lacks: there each block is padded to the
  operand's rows and sent by a dense all_to_all, then placed as the ragged one places it."""
  if platform_in_context() != "cpu":
    return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                                     recv_sizes, axis_name=axes)
  rows = jnp.arange(operand.shape[0])
  blocks = jnp.where((rows < send_sizes[:, None])[..., None],
                     operand[jnp.minimum(input_offsets[:, None] + rows, rows.size - 1)], 0)
  arrived = jax.lax.all_to_all(blocks, axes, 0, 0)
  landing = jax.lax.all_to_all(output_offsets, axes, 0, 0)  # Where each source's block goes.
  targets = jnp.where(rows < recv_sizes[:, None], landing[:, None] + rows, output.shape[0])
  return output.at[targets.reshape(-1)].set(arrived.reshape(-1, operand.shape[1]), mode="drop")
