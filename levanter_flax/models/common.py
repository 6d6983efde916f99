"""What every model family shares: the compute settings (remat, dtypes, the attention backend,
scan), layout constraints, and the stack of layers (unrolled or scanned)."""
import dataclasses
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from levanter_flax.core.errors import UserError
from levanter_flax.core.schema import STATE, setting
from levanter_flax.models import pipeline


# The name int8's products carry (models/int8.py): their dot_general hides in a custom_vjp,
# where the policies that keep dots' outputs cannot see it.
INT8_PRODUCT = "int8_product"


def _keeping_int8_products(policy, products_policy):
  """`policy`, and `products_policy` for the outputs named INT8_PRODUCT."""
  def combined(prim, *args, **params):
    if prim.name == "name" and params.get("name") == INT8_PRODUCT:
      return products_policy(prim, *args, **params)
    return policy(prim, *args, **params)
  return combined


_policies = jax.checkpoint_policies
_SAVE_PRODUCTS = _policies.save_only_these_names(INT8_PRODUCT)
# What each transformer block keeps for the backward pass; the rest is recomputed.
REMAT_POLICIES = {
    "none": None,  # Keep everything: no recomputation.
    "full": _policies.nothing_saveable,  # Keep only the block's input.
    "dots_saveable": _keeping_int8_products(_policies.dots_saveable, _SAVE_PRODUCTS),
    "dots_with_no_batch_dims_saveable": _keeping_int8_products(
        _policies.dots_with_no_batch_dims_saveable, _SAVE_PRODUCTS),
    # Like the above, but the saved matmul outputs wait in host memory.
    "offload": _keeping_int8_products(
        _policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
        _policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=[INT8_PRODUCT],
            offload_src="device", offload_dst="pinned_host")),
}
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "cudnn", "splash")
# Splash attention's blocks tile the sequence in multiples of a TPU vector register's lanes.
SPLASH_BLOCK_MULTIPLE = 128


DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = ("none", "int8")

# The collections a layer sows into, stacked per layer like its params: the losses the step adds
# (a mixture's router losses), the router's metrics, and a sigmoid router's copies per expert
# for its balancing biases (moe.py).
BALANCE = "balance"
SOWN_COLLECTIONS = ("losses", "router", BALANCE)


def _remat(key: str, value: Any) -> str:
  """A policy name; True and False (or their strings) are "full" and "none"."""
  if isinstance(value, bool) or str(value).lower() in ("true", "false"):
    return "full" if str(value).lower() == "true" else "none"
  if value not in REMAT_POLICIES:
    raise UserError(f"config key {key} must be True, False or one of "
                    f"{', '.join(REMAT_POLICIES)}; got {value!r}")
  return value


@dataclasses.dataclass(frozen=True)
class ComputeConfig:
  """How a model computes, the same for every family (config.model.compute)."""
  remat: str = setting(
      "none", "Gradient checkpointing per block: none, full (recompute the block), "
      "dots_saveable, dots_with_no_batch_dims_saveable, or offload (saved matmul outputs wait "
      "in host memory, where the backend supports it); True is full", convert=_remat)
  dtype: str = setting("float32", "Compute: float32, bfloat16 or float16")
  param_dtype: str = setting("float32", "Parameters and optimizer state; the loss is always "
                             "float32", STATE)
  attention_impl: str = setting(
      "auto", "xla (XLA's own, on any device), cudnn (cuDNN's flash attention, NVIDIA GPUs), "
      "splash (Pallas splash attention, TPUs: blockwise, skipping the masked-out blocks), or "
      "auto: splash on a TPU, cudnn on an NVIDIA GPU in 16-bit compute, else xla; decoding "
      "always uses xla")
  splash_block_q: int = setting(
      512, "splash: query rows per kernel block, a multiple of 128 (clipped to the sequence "
      "length, per sequence shard)")
  splash_block_kv: int = setting(
      512, "splash: key and value rows per kernel block, a multiple of 128 (clipped to the "
      "sequence length)")
  splash_fused_backward: bool = setting(
      True, "splash: one backward kernel computes the query, key and value gradients together "
      "(on a v5e chip attention took 10-19% less time than with a kernel for the queries' and "
      "one for the keys' and values'; docs/Performance-Guide.md)")
  scan_layers: bool = setting(False, "Run the blocks as one lax.scan over stacked parameters: "
                              "compile time stays flat as depth grows", STATE)
  cross_entropy_block_size: int = setting(
      0, "> 0: the loss computes logits this many vocabulary entries at a time and never holds "
      "them all; 0: plain")
  quantization: str = setting(
      "none", "none, or int8: the layers' projections and a mixture's experts multiply int8 x "
      "int8 -> int32 in the forward and backward passes, with per-channel scales "
      "(models/int8.py); the weights, the optimizer state, the embeddings, the router and the "
      "head keep their dtypes")
  cache_dtype: str = setting(
      "auto", "Decoding's key/value cache: auto (the compute dtype), float32, bfloat16 or "
      "float16; bfloat16 halves a float32 model's cache, which each decode step reads whole")

  @property
  def splash_blocks(self) -> "SplashBlocks":
    return SplashBlocks(self.splash_block_q, self.splash_block_kv, self.splash_fused_backward)

  def __post_init__(self):
    for key in ("dtype", "param_dtype"):
      if getattr(self, key) not in DTYPES:
        raise UserError(f"config.model.compute.{key} must be {', '.join(DTYPES[:-1])} or "
                        f"{DTYPES[-1]}; got {getattr(self, key)!r}")
    if self.cache_dtype not in ("auto", *DTYPES):
      raise UserError(f"config.model.compute.cache_dtype must be auto, {', '.join(DTYPES[:-1])} "
                      f"or {DTYPES[-1]}; got {self.cache_dtype!r}")
    if self.attention_impl not in ATTENTION_IMPLEMENTATIONS:
      raise UserError(f"config.model.compute.attention_impl must be one of "
                      f"{', '.join(ATTENTION_IMPLEMENTATIONS)}; got {self.attention_impl!r}")
    for key in ("splash_block_q", "splash_block_kv"):
      if getattr(self, key) <= 0 or getattr(self, key) % SPLASH_BLOCK_MULTIPLE:
        raise UserError(f"config.model.compute.{key} must be a positive multiple of "
                        f"{SPLASH_BLOCK_MULTIPLE}; got {getattr(self, key)}")
    if self.quantization not in QUANTIZATIONS:
      raise UserError(f"config.model.compute.quantization must be one of "
                      f"{', '.join(QUANTIZATIONS)}; got {self.quantization!r}")
    if self.cross_entropy_block_size < 0:
      raise UserError(f"config.model.compute.cross_entropy_block_size must be >= 0 (0: off); "
                      f"got {self.cross_entropy_block_size}")


class SplashBlocks(NamedTuple):
  """Splash attention's kernel blocks (ComputeConfig's splash_* settings)."""
  q: int
  kv: int
  fused_backward: bool = True


def compute_section() -> Any:
  """The `compute` field every family's config declares, keyword-only so that it may follow
  the family's required fields."""
  return setting(ComputeConfig(), "How the model computes: remat, dtypes, attention, scan",
                 kw_only=True)


def cache_dtype(compute: ComputeConfig) -> str | None:
  """Decoding's key/value cache's dtype, or None for the compute dtype's (its `auto`)."""
  return None if compute.cache_dtype == "auto" else compute.cache_dtype


def with_compute(cfg, **changes):
  """A model config with some of its compute settings changed."""
  return dataclasses.replace(cfg, compute=dataclasses.replace(cfg.compute, **changes))


def check_config(cfg, sizes: tuple[str, ...]) -> None:
  """What every family's config dataclass checks of itself, in __post_init__: its `sizes`
  positive, the heads dividing the width."""
  for name in sizes:
    if getattr(cfg, name) <= 0:
      raise UserError(f"config key config.model.{name} must be positive, got {getattr(cfg, name)}")
  if cfg.hidden_dim % cfg.num_heads:
    raise UserError(f"config.model.hidden_dim ({cfg.hidden_dim}) must be divisible by "
                    f"config.model.num_heads ({cfg.num_heads})")


def platform_in_context() -> str:
  """The platform of the mesh in context (jax.set_mesh, as Partitioner.activation_context
  sets it), else the default backend's: a compile ahead of time for TPU devices runs on a CPU
  host."""
  device = jax.sharding.get_abstract_mesh().abstract_device
  return device.platform if device else jax.default_backend()


def attention_implementation(cfg, platform: str | None = None) -> str:
  """cfg's attention kernel on `platform` (default: platform_in_context()). 'auto' is splash
  on TPUs, cuDNN's flash attention on NVIDIA GPUs in 16-bit compute, XLA's elsewhere.

  step.build resolves it for the devices of the mesh it compiles for; models applied
  otherwise (sampling, tests) resolve it here.
  """
  if cfg.compute.attention_impl != "auto":
    return cfg.compute.attention_impl
  platform = platform or platform_in_context()
  if platform == "tpu":
    return "splash"
  sixteen_bit = cfg.compute.dtype in ("bfloat16", "float16")
  return "cudnn" if platform == "gpu" and sixteen_bit else "xla"


def check_attention_platform(implementation: str, platform: str) -> None:
  """Splash attention is a Mosaic kernel: it compiles for TPUs only."""
  if implementation == "splash" and platform != "tpu":
    raise UserError(f"config.model.compute.attention_impl 'splash' runs on TPU only; this "
                    f"mesh's devices are {platform} (levanter-flax aot compiles for a "
                    f"TPU from any machine)")


def cast_in_layer(params: jax.Array, dtype) -> jax.Array:
  """params.astype(dtype), computed where it is written, inside a scanned layer: lora.Dense's
  kernels and moe's expert stacks.

  XLA's TPU compiler moves a narrowing convert of a layer's slice of scanned params to the
  whole stack, then out of the layer loop, so that a bfloat16 copy of every layer's weights
  (their ZeRO-3 share) lives through the forward and backward loops: 1.7 GiB a chip for
  Qwen3-30B-A3B's experts, 0.4 for Llama-2-7B on v5p-64. float32 to bfloat16 is therefore
  rounded here by hand, as convert rounds (to nearest, ties to even), which the compiler does
  not take for a convert. (The chip's convert flushes float32 subnormals to zero; this rounds
  the few within half a step of bfloat16's smallest normal up to it, as IEEE does.) Other
  platforms' compilers keep the convert in the loop: there it is a plain convert."""
  if (params.dtype != jnp.float32 or jnp.dtype(dtype) != jnp.bfloat16
      or platform_in_context() != "tpu"):
    return params.astype(dtype)
  return float32_to_bfloat16(params)


@jax.custom_vjp
def float32_to_bfloat16(x: jax.Array) -> jax.Array:
  """x.astype(bfloat16) for float32 x, bit for bit, by integer arithmetic (cast_in_layer)."""
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # Carries into the exponent as it must.
  narrowed = jax.lax.bitcast_convert_type(rounded.astype(jnp.uint16), jnp.bfloat16)
  return jnp.where(jnp.isnan(x), jnp.bfloat16(jnp.nan), narrowed)  # A NaN's carry would wrap.


float32_to_bfloat16.defvjp(lambda x: (float32_to_bfloat16(x), None),
                            lambda _, cotangent: (cotangent.astype(jnp.float32),))


def constrain(x: jax.Array, *logical_axes) -> jax.Array:
  """Pins an activation's layout by logical axis names; a no-op outside a mesh.

  partitioning.Partitioner.activation_context maps the names to mesh axes
  ('batch' to the activation axis; 'heads', 'mlp' and 'vocab' to the tensor
  axis), which keeps XLA on the intended layout instead of guessing.
  """
  return nn.with_logical_constraint(x, logical_axes)


def stack_layers(layer_cls, cfg, decode: bool, name: str, x: jax.Array, shared,
                 per_layer: tuple | None = None, layers: range | None = None,
                 unrolled_name: str | None = None) -> jax.Array:
  """cfg.num_layers layers, each rematerialised per cfg.compute.remat, unrolled (<name>_<i>) or as
  one nn.scan over parameters stacked on a leading layer axis (<name>), e.g. h/attn/c_attn/kernel
  of shape [L, D, 3D]; in decode mode the KV caches are stacked the same way. Every layer is
  called as layer(x, shared): `shared` (the token mask, positions) is the same for all.

  per_layer: where the layers differ (Gemma 3's local and global layers), one value a layer,
  passed as layer(x, shared, value): the Python value itself to an unrolled layer (static: it
  may choose the code), its element of jnp.asarray(per_layer) to a scanned one (traced). In
  decode mode such layers run unrolled even on stacked params (_UnrolledOnStack), so that each
  keeps a cache of its own shape (a local layer only its window).

  layers, unrolled_name: a model of two kinds of layer (DeepSeek-V3's dense ones, then its
  mixtures) stacks each kind apart: `layers` the indices of this kind (by default all), named
  <unrolled_name>_<i> unrolled (by default <name>_<i>).

  A scanned stack traced by a pipelined step on a mesh with stages runs as pipeline.run
  schedules it, on the params the scan initialised.
  """
  layers = range(cfg.num_layers) if layers is None else layers
  if not layers:
    return x
  remat = cfg.compute.remat
  static = () if per_layer is None or cfg.compute.scan_layers else (3,)  # self, x, shared, value.
  # Decoding has no backward pass to save memory for; and a rematerialised layer's per_layer
  # value would be traced, hiding a local layer's kind from its cache.
  layer = layer_cls if remat == "none" or decode else nn.remat(
      layer_cls, policy=REMAT_POLICIES[remat], static_argnums=static)
  if cfg.compute.scan_layers and decode and per_layer is not None:
    stacked = nn.map_variables(_UnrolledOnStack, "params", _unstacked, _stacked,
                               mutable=True)
    return stacked(layer, cfg, tuple(per_layer[i] for i in layers), name=name)(x, shared)
  if cfg.compute.scan_layers:
    stack = layer(cfg, decode, name=name)
    schedule = None if decode else pipeline.schedule_in_context()
    if schedule is not None and not stack.is_initializing():
      return pipeline.run(layer, cfg, stack, x, shared, per_layer, schedule, SOWN_COLLECTIONS,
                          (BALANCE,))
    scanned = dict(variable_axes={name: 0 for name in ("params", "cache", *SOWN_COLLECTIONS)},
                   split_rngs={"params": True, "dropout": True},  # LoRA's dropout, per layer.
                   length=len(layers))
    if per_layer is None:
      scan = nn.scan(lambda module, carry, shared: (module(carry, shared), None),
                     in_axes=nn.broadcast, **scanned)
      x, _ = scan(stack, x, shared)
    else:
      scan = nn.scan(lambda module, carry, shared, value: (module(carry, shared, value), None),
                     in_axes=(nn.broadcast, 0), **scanned)
      x, _ = scan(stack, x, shared, jnp.asarray(per_layer))
    return x
  for i in layers:
    extra = () if per_layer is None else (per_layer[i],)
    x = layer(cfg, decode, name=f"{unrolled_name or name}_{i}")(x, shared, *extra)
  return x


class _UnrolledOnStack(nn.Module):
  """Layers called one by one, layer_<i> the i-th, on params that map_variables keeps stacked
  (as the scanned model's: _unstacked and _stacked)."""
  layer: Any
  config: Any
  per_layer: tuple

  @nn.compact
  def __call__(self, x: jax.Array, shared) -> jax.Array:
    for i, value in enumerate(self.per_layer):
      x = self.layer(self.config, True, name=f"layer_{i}")(x, shared, value)
    return x


def _unstacked(variables: dict) -> dict:
  """{collection: a stack [layers, ...]} as {collection: {layer_<i>: the i-th}}."""
  def unstack(tree):
    if not tree:  # Initialising: nothing yet.
      return tree
    count = jax.tree.leaves(tree)[0].shape[0]
    return {f"layer_{i}": jax.tree.map(lambda x, i=i: x[i], tree) for i in range(count)}
  return {collection: unstack(tree) for collection, tree in variables.items()}


def _stacked(variables: dict) -> dict:
  """_unstacked's inverse."""
  def stack(tree):
    layers = [tree[f"layer_{i}"] for i in range(len(tree))]
    return jax.tree.map(lambda *xs: jnp.stack(xs), *layers) if layers else tree
  return {collection: stack(tree) for collection, tree in variables.items()}
