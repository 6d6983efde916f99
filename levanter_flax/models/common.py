"""What both model families share: remat policies, the attention backend, layout
constraints, and the stack of layers (unrolled or scanned)."""
import flax.linen as nn
import jax

from levanter_flax.errors import UserError


# What each transformer block keeps for the backward pass; the rest is recomputed.
REMAT_POLICIES = {
    "none": None,  # Keep everything: no recomputation.
    "full": jax.checkpoint_policies.nothing_saveable,  # Keep only the block's input.
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # Like the above, but the saved matmul outputs wait in host memory.
    "offload": jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
}
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "cudnn")


DTYPES = ("float32", "bfloat16", "float16")


def check_config(cfg, sizes: tuple[str, ...]) -> None:
  """What every family's config dataclass checks of itself, in __post_init__: its `sizes`
  positive, the heads dividing the width, the compute keys known."""
  for name in sizes:
    if getattr(cfg, name) <= 0:
      raise UserError(f"config key config.model.{name} must be positive, got {getattr(cfg, name)}")
  if cfg.hidden_dim % cfg.num_heads:
    raise UserError(f"config.model.hidden_dim ({cfg.hidden_dim}) must be divisible by "
                    f"config.model.num_heads ({cfg.num_heads})")
  for key in ("dtype", "param_dtype"):
    if getattr(cfg, key) not in DTYPES:
      raise UserError(f"config.model.{key} must be {', '.join(DTYPES[:-1])} or {DTYPES[-1]}; "
                      f"got {getattr(cfg, key)!r}")
  if cfg.attention_impl not in ATTENTION_IMPLEMENTATIONS:
    raise UserError(f"config.model.attention_impl must be one of "
                    f"{', '.join(ATTENTION_IMPLEMENTATIONS)}; got {cfg.attention_impl!r}")
  if cfg.cross_entropy_block_size < 0:
    raise UserError(f"config.model.cross_entropy_block_size must be >= 0 (0: off); "
                    f"got {cfg.cross_entropy_block_size}")


def attention_implementation(cfg) -> str:
  """'auto' is cuDNN's flash attention on NVIDIA GPUs in 16-bit compute, XLA's elsewhere."""
  if cfg.attention_impl != "auto":
    return cfg.attention_impl
  on_gpu = jax.default_backend() == "gpu"
  return "cudnn" if on_gpu and cfg.dtype in ("bfloat16", "float16") else "xla"


def constrain(x: jax.Array, *logical_axes) -> jax.Array:
  """Pins an activation's layout by logical axis names; a no-op outside a mesh.

  partitioning.Partitioner.activation_context maps the names to mesh axes
  ('batch' to the activation axis; 'heads', 'mlp' and 'vocab' to the tensor
  axis), which keeps XLA on the intended layout instead of guessing.
  """
  return nn.with_logical_constraint(x, logical_axes)


def stack_layers(layer_cls, cfg, decode: bool, name: str, x: jax.Array, shared) -> jax.Array:
  """cfg.num_layers layers, each rematerialised per cfg.remat, unrolled (<name>_<i>) or as
  one nn.scan over parameters stacked on a leading layer axis (<name>), e.g. h/attn/c_attn/kernel
  of shape [L, D, 3D]; in decode mode the KV caches are stacked the same way. Every layer is
  called as layer(x, shared): `shared` (the token mask, positions) is the same for all."""
  layer = layer_cls if cfg.remat == "none" else nn.remat(layer_cls, policy=REMAT_POLICIES[cfg.remat])
  if cfg.scan_layers:
    layers = nn.scan(lambda module, carry, shared: (module(carry, shared), None),
                     variable_axes={"params": 0, "cache": 0, "losses": 0}, split_rngs={"params": True},
                     in_axes=nn.broadcast, length=cfg.num_layers)
    x, _ = layers(layer(cfg, decode, name=name), x, shared)
    return x
  for i in range(cfg.num_layers):
    x = layer(cfg, decode, name=f"{name}_{i}")(x, shared)
  return x
