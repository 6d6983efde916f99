"""What both model families share: remat policies, the attention backend, layout
constraints, and the stack of layers (unrolled or scanned)."""
import flax.linen as nn
import jax


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
                     variable_axes={"params": 0, "cache": 0}, split_rngs={"params": True},
                     in_axes=nn.broadcast, length=cfg.num_layers)
    x, _ = layers(layer(cfg, decode, name=name), x, shared)
    return x
  for i in range(cfg.num_layers):
    x = layer(cfg, decode, name=f"{name}_{i}")(x, shared)
  return x
