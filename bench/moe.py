"""The experts' grouped matmul: models/moe.py's (flat tokens in shard_map, expert parallelism by
ragged all-to-all) against the one it replaced (each sequence sorted apart, one
ragged_dot_general with a batch dimension, which TPUs cannot lower), on 8 devices.

    python bench/moe.py [--tokens_per_device=2048 --repeats=5]

For a Mixtral-nano-like shape (8 experts, 2 per token) and a 64-expert one (8 per token), one
MoE layer's forward and backward (the gradient of the squared outputs with respect to the
input, the routing weights and the three expert stacks) on a data=8 mesh, and the new one on
expert=8 too. It prints tokens/s (median of --repeats), the compiled step's temporary bytes,
and one device's compiled FLOPs over its share of the routed experts' FLOPs (18 x tokens x k x
hidden x width: forward and backward of the three matrices). On a CPU box it fakes 8 devices.
XLA:CPU computes a grouped matmul as a dense one over every expert, masked, so there the ratio
is the expert count, before and now alike; `aot` gives the TPU compiler's count. Uses jax and
flax only.
"""
import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import flax.linen as nn  # pylint: disable=g-import-not-at-top
import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

from levanter_flax.models import moe  # pylint: disable=g-import-not-at-top
from levanter_flax.parallel import partitioning  # pylint: disable=g-import-not-at-top

SHAPES = {  # name: (hidden, expert width, experts, per token)
    "mixtral nano (8 experts, top-2)": (128, 96, 8, 2),
    "64 experts, top-8": (128, 64, 64, 8),
}
# ragged_dot_general's mode 1: rows [sequences, copies, hidden] ragged along the copies.
_PER_SEQUENCE = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([2], [1]), ([], [])), lhs_ragged_dimensions=[1],
    rhs_group_dimensions=[0])


def per_sequence_experts(x, experts, weights, gate, up, down):
  """The replaced layer: each sequence's copies sorted by expert, grouped per sequence."""
  num_experts, k = gate.shape[0], experts.shape[-1]
  experts = experts.reshape(x.shape[0], -1)
  order = jnp.argsort(experts, axis=-1, stable=True)
  group_sizes = jax.nn.one_hot(experts, num_experts, dtype=jnp.int32).sum(axis=1)
  rows = jnp.take_along_axis(x, order[..., None] // k, axis=1)
  matmul = lambda a, w: jax.lax.ragged_dot_general(a, w, group_sizes, _PER_SEQUENCE)
  outputs = matmul(nn.silu(matmul(rows, gate)) * matmul(rows, up), down)
  outputs = jnp.take_along_axis(outputs, jnp.argsort(order, axis=-1)[..., None], axis=1)
  return jnp.einsum("blkd,blk->bld", outputs.reshape(*weights.shape, -1), weights)


def flat_experts(x, experts, weights, gate, up, down):
  return moe.routed_experts(moe.MoeConfig(num_experts=gate.shape[0],
                                          num_experts_per_token=experts.shape[-1]),
                            x, experts, weights, gate, up, down)[0]


def measure(layer, mesh_axes, shape, tokens_per_device: int, repeats: int) -> tuple:
  hidden, width, num_experts, k = shape
  sequence = 256
  batch = 8 * tokens_per_device // sequence
  sharding = partitioning.ShardingConfig(
      activation_axis=mesh_axes[0][0], tensor_axis=None,
      expert_axis="expert" if dict(mesh_axes).get("expert", 1) > 1 else None)
  partitioner = partitioning.Partitioner(partitioning.make_mesh(mesh_axes), sharding)
  keys = jax.random.split(jax.random.key(0), 5)
  x = jax.random.normal(keys[0], (batch, sequence, hidden))
  logits = jax.random.normal(keys[1], (batch, sequence, num_experts))
  experts, weights, _ = moe.route(moe.MoeConfig(num_experts=num_experts,
                                                num_experts_per_token=k), logits)
  stacks = [jax.random.normal(key, s) * 0.02 for key, s in zip(
      keys[2:], [(num_experts, hidden, width)] * 2 + [(num_experts, width, hidden)])]
  with partitioner.activation_context():
    batch_sharding = NamedSharding(partitioner.mesh, P(partitioner.logical_axes["batch"]))
    stack_sharding = NamedSharding(partitioner.mesh, P(partitioner.logical_axes["experts"]))
    args = [jax.device_put(a, batch_sharding) for a in (x, experts, weights)] + [
        jax.device_put(s, stack_sharding) for s in stacks]
    grads = jax.jit(jax.grad(lambda x, e, w, *s: jnp.sum(layer(x, e, w, *s) ** 2),
                             argnums=(0, 2, 3, 4, 5)))
    compiled = grads.lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      jax.block_until_ready(compiled(*args))
      times.append(time.perf_counter() - start)
  cost = compiled.cost_analysis()
  flops = (cost[0] if isinstance(cost, list) else cost)["flops"]
  # The compiled program is one device's: so are its FLOPs.
  routed = 18 * x.shape[0] * x.shape[1] * k * hidden * width / jax.device_count()
  return (x.shape[0] * x.shape[1] / statistics.median(times),
          compiled.memory_analysis().temp_size_in_bytes, flops / routed)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--tokens_per_device", type=int, default=2048)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  print(f"{jax.device_count()} x {jax.devices()[0].platform}, {args.tokens_per_device} tokens "
        f"per device")
  print(f"| shape | layer | mesh | tokens/s | temp MiB | compiled / routed FLOPs |")
  print("|---|---|---|---|---|---|")
  for name, shape in SHAPES.items():
    for label, layer, mesh_axes in [
        ("per sequence (before)", per_sequence_experts, (("data", 8),)),
        ("flat, shard_map (now)", flat_experts, (("data", 8),)),
        ("flat, shard_map (now)", flat_experts, (("expert", 8),))]:
      tokens_per_second, temp, ratio = measure(layer, mesh_axes, shape, args.tokens_per_device,
                                               args.repeats)
      mesh = ",".join(f"{a}={n}" for a, n in mesh_axes)
      print(f"| {name} | {label} | {mesh} | {tokens_per_second:,.0f} | {temp / 2**20:.1f} | "
            f"{ratio:.2f} |", flush=True)


if __name__ == "__main__":
  main()
