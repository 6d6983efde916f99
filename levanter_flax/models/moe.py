"""Mixtures of experts: the config section (config.model.moe), routing, and the routed experts
computed as one grouped matmul over each device's tokens, sent to their experts' devices.

May import core and the models package's common and lora; the families with experts
(mixtral, qwen3_moe) build their feed-forward block from `MoeBlock`.

Routing is data-parallel, as any layer: the router (`mlp/gate`, no bias) scores each token,
which goes to its num_experts_per_token best experts, weighted by their probabilities
(renormalised over those chosen with normalize_top_k, as Mixtral always does).

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
   (`jax.lax.ragged_dot`, no batch dimension; or Pallas megablox `gmm`). Under ZeRO-3 the
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
load, the router's entropy, and the fraction of token copies dropped.
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
from levanter_flax.models import lora
from levanter_flax.models.common import constrain, platform_in_context

# Each expert stack's logical axes: its partition rule, and its layout inside the layer.
EXPERT_AXES = {"gate_proj": ("experts", "embed", "mlp"), "up_proj": ("experts", "embed", "mlp"),
               "down_proj": ("experts", "mlp", "embed")}
PARTITION_RULES = (
    (r"mlp/gate/kernel$", ("embed", None)),  # The router: small, whole on every device.
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
    for key in ("router_aux_loss_coef", "router_z_loss_coef"):
      if not getattr(self, key) >= 0:
        raise UserError(f"config.model.moe.{key} must be >= 0, got {getattr(self, key)}")

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


def loss_coefficients(cfg) -> dict[str, float]:
  """The weight in the training loss of each auxiliary loss a model config's layers sow."""
  moe = getattr(cfg, "moe", None)
  return {} if moe is None else {"router_aux_loss": moe.router_aux_loss_coef,
                                 "router_z_loss": moe.router_z_loss_coef}


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
                    projections: dict[str, str]) -> dict[str, tuple]:
  """A dense family's names (`dense_names`: path -> (HF tensor name, transposed?)) with each
  layer's MLP as a router and expert stacks, the experts' Linear layers saved apart
  (transformers 4 and 5 alike): `block` the HF feed-forward module (Mixtral's
  block_sparse_moe), `projections` our stacks' names -> theirs."""
  names = {ours: theirs for ours, theirs in dense_names.items() if "/mlp/" not in ours}
  for i in range(cfg.num_layers):
    prefix = f"model.layers.{i}.{block}"
    names[f"layers_{i}/mlp/gate/kernel"] = (f"{prefix}.gate.weight", True)
    for ours, theirs in projections.items():
      names[f"layers_{i}/mlp/experts/{ours}"] = (
          tuple(f"{prefix}.experts.{e}.{theirs}.weight" for e in range(cfg.moe.num_experts)), True)
  return names


def route(cfg: MoeConfig, logits: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(experts [..., k] int32, their weights [..., k] float32, probabilities [..., experts])."""
  probabilities = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  # lax.top_k's partitioner gathers the whole batch to every device; a sort keeps it split.
  experts = jnp.argsort(-probabilities, axis=-1, stable=True)[..., :cfg.num_experts_per_token]
  weights = jnp.take_along_axis(probabilities, experts, axis=-1)
  if cfg.normalize_top_k:
    weights = weights / weights.sum(axis=-1, keepdims=True)
  return experts.astype(jnp.int32), weights, probabilities


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
  stacked on a leading expert axis (`experts/gate_proj` [experts, hidden, mlp], ...).

  `config`: a family's config with hidden_dim, intermediate_dim, initializer_range, compute,
  lora and moe."""
  config: Any

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
    experts, weights, probabilities = (constrain(a, "batch", "length", None)
                                       for a in route(moe, logits))
    self.sow("losses", "router_aux_loss", load_balancing_loss(probabilities, experts))
    self.sow("losses", "router_z_loss", jnp.square(jax.nn.logsumexp(logits, axis=-1)).mean())
    mixed, dropped = Experts(cfg, name="experts")(x, experts,
                                                  weights.astype(cfg.compute.dtype))
    load = jax.nn.one_hot(experts, moe.num_experts, dtype=jnp.float32).sum(axis=(0, 1, 2))
    self.sow("router", "load_max_over_mean", load.max() / load.mean())
    self.sow("router", "entropy", -jnp.sum(probabilities * jnp.log(probabilities + 1e-30),
                                           axis=-1).mean())
    self.sow("router", "dropped_fraction", dropped / experts.size)
    return constrain(mixed, "batch", "length", "embed")


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
    wide = (cfg.moe.num_experts, cfg.hidden_dim, cfg.intermediate_dim)
    shapes = {"gate_proj": wide, "up_proj": wide, "down_proj": wide[:1] + wide[:0:-1]}
    # With LoRA adapters added, then in the compute dtype: any ZeRO-3 split is gathered in it
    # (routed_experts).
    stacks = [lora.with_stack_adapters(self, cfg.lora, name, self.param(
        name, init, shape, cfg.compute.param_dtype)).astype(cfg.compute.dtype)
              for name, shape in shapes.items()]
    return routed_experts(cfg.moe, x, experts, weights, *stacks)


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
                   gate: jax.Array, up: jax.Array, down: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Experts' computation over the mesh in context (see the module docstring); without a mesh,
  on one device."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not nn.get_logical_axis_rules():
    return _on_device(cfg, _Layout(), x, experts, weights, gate, up, down)
  layout, token_spec, stack_specs = _layout(dict(mesh.shape), x.shape,
                                            dict(zip(EXPERT_AXES["gate_proj"], gate.shape)))
  routing_spec = P(*token_spec[:2], None)
  # Megablox declares its outputs without the mesh axes they vary over, which only an
  # unchecked shard_map accepts.
  on_device = jax.shard_map(
      lambda *args: _on_device(cfg, layout, *args), out_specs=(P(*token_spec), P()),
      check_vma=grouped_matmul(cfg) != "gmm",
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


def _on_device(cfg: MoeConfig, layout: _Layout, x, experts, weights, gate, up, down):
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
  outputs, dropped = _copies_through_experts(cfg, layout, x, experts, weights, gate, up, down)
  if shares > 1:
    outputs = jax.lax.all_gather(outputs, share_axes, tiled=True, to="invarying")[:total]
    dropped = jax.lax.psum(dropped, share_axes)
  if layout.token_axes:
    dropped = jax.lax.psum(dropped, layout.token_axes)
  return outputs.reshape(shape), dropped


def _copies_through_experts(cfg: MoeConfig, layout: _Layout, x, experts, weights, gate, up, down):
  """x [T, hidden], experts and weights [T, k]: each token's weighted sum of its experts'
  outputs, and the number of copies dropped (float32)."""
  k = experts.shape[-1]
  copies, dropped = _kept_copies(cfg, experts.reshape(-1))
  order = jnp.argsort(copies, stable=True)  # By expert; dropped copies (num_experts) last.
  counts = jnp.bincount(copies, length=cfg.num_experts + 1)[:-1].astype(jnp.int32)
  rows = x[order // k]
  if layout.size(layout.expert_axes) > 1:
    outputs = _exchange(cfg, layout, rows, counts, gate, up, down, _inbox_rows(cfg, layout, rows))
  else:
    outputs = _grouped_mlp(cfg, layout, rows, counts, gate, up, down)
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


def _grouped_mlp(cfg: MoeConfig, layout: _Layout, rows, group_sizes, gate, up, down):
  """SwiGLU per expert on rows grouped by expert (group_sizes rows each; any rows after them
  give zeros), summed over the axes that split the width."""
  if grouped_matmul(cfg) == "gmm":
    # gmm leaves the rows after the groups unwritten, forward and back: they are zeroed going
    # in (which zeroes their gradient) and coming out.
    grouped = (jnp.arange(rows.shape[0] - rows.shape[0] % -GMM_ROW_TILE)
               < group_sizes.sum())[:, None]
    interpret = platform_in_context() != "tpu"
    matmul = lambda a, w: megablox.gmm(a, w, group_sizes, a.dtype, (GMM_ROW_TILE, 128, 128),
                                       None, None, False, interpret)
    padded = jnp.where(grouped, jnp.pad(rows, ((0, grouped.size - rows.shape[0]), (0, 0))), 0)
    outputs = jnp.where(grouped, _swiglu(matmul, padded, gate, up, down), 0)[:rows.shape[0]]
  else:
    outputs = _swiglu(lambda a, w: jax.lax.ragged_dot(a, w, group_sizes), rows, gate, up, down)
  return jax.lax.psum(outputs, layout.width_axes) if layout.width_axes else outputs


def _swiglu(matmul, rows, gate, up, down):
  return matmul(nn.silu(matmul(rows, gate)) * matmul(rows, up), down)


def _exclusive_cumsum(a: jax.Array, axis: int = 0) -> jax.Array:
  return jnp.cumsum(a, axis=axis) - a


def _exchange(cfg: MoeConfig, layout: _Layout, rows, counts, gate, up, down, inbox_rows: int):
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
  outputs = _grouped_mlp(cfg, layout, inbox[regroup], mine.sum(0), gate, up, down)
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
