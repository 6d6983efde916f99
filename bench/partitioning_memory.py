"""Per-device memory and step time of each mesh layout, on 8 devices.

    python bench/partitioning_memory.py [--num_layers=4 --hidden_dim=256 ...]

On a CPU box it fakes 8 devices. For each layout it prints the per-device
bytes of parameters and optimizer state (from the shardings), the compiled
train step's temp bytes (XLA's memory analysis) and the median step time.
Uses only jax, flax and optax: no TensorFlow, no data files.
"""
import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

from levanter_flax import optim, partitioning, step  # pylint: disable=g-import-not-at-top
from levanter_flax.models.gpt2 import PARTITION_RULES, GPT2Config, GPT2LMHeadModel  # pylint: disable=g-import-not-at-top


def _sharding(parameter_axis=None, tensor_parallel=False) -> partitioning.ShardingConfig:
  return partitioning.ShardingConfig(
      rules=PARTITION_RULES if tensor_parallel else (), activation_axis="data",
      parameter_axis=parameter_axis, optimizer_axis=None,
      tensor_axis="model" if tensor_parallel else None, strict=False)


LAYOUTS = {
    "data=8": ((("data", 8),), _sharding()),
    "data=4,model=2 (TP)": ((("data", 4), ("model", 2)), _sharding(tensor_parallel=True)),
    "data=8 ZeRO-3": ((("data", 8),), _sharding(parameter_axis="data")),
    "data=2,model=4 TP+ZeRO-3": ((("data", 2), ("model", 4)),
                                 _sharding(parameter_axis="data", tensor_parallel=True)),
}


def measure(device_mesh, sharding, model_cfg: GPT2Config, batch_size: int, num_steps: int) -> dict:
  partitioner = partitioning.Partitioner(partitioning.make_mesh(device_mesh), sharding)
  opt_cfg = optim.OptimizerConfig(learning_rate=1e-3, warmup_steps=10, weight_decay=0.1,
                                  max_grad_norm=1.0, beta1=0.9, beta2=0.95, epsilon=1e-8,
                                  min_learning_rate_ratio=0.1)
  schedule = optim.learning_rate_schedule(opt_cfg, 1000)
  steps = step.build_sharded_steps(GPT2LMHeadModel(model_cfg), optim.make_optimizer(opt_cfg, schedule),
                                   schedule, partitioner, model_cfg.seq_len)
  tokens = np.random.default_rng(0).integers(0, model_cfg.vocab_size, (batch_size, model_cfg.seq_len))
  with partitioner.activation_context():
    state = steps.init(jax.random.key(0))
    batch = {"tokens": jax.device_put(tokens.astype(np.int32), steps.batch_sharding)}
    compiled = steps.train_step.lower(state, batch).compile()
    times = []
    for _ in range(num_steps + 1):  # The first call is a warm-up.
      start = time.perf_counter()
      state, metrics = compiled(state, batch)
      jax.block_until_ready(metrics)
      times.append(time.perf_counter() - start)
  abstract, shardings = steps.abstract_state, steps.state_shardings
  return {
      "params": partitioning.per_device_bytes(abstract.params, shardings.params),
      "opt_state": partitioning.per_device_bytes(abstract.opt_state, shardings.opt_state),
      "temp": compiled.memory_analysis().temp_size_in_bytes,
      "step_s": statistics.median(times[1:]),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--num_layers", type=int, default=4)
  parser.add_argument("--hidden_dim", type=int, default=256)
  parser.add_argument("--num_heads", type=int, default=4)
  parser.add_argument("--seq_len", type=int, default=256)
  parser.add_argument("--vocab_size", type=int, default=8192)
  parser.add_argument("--batch_size", type=int, default=16)
  parser.add_argument("--num_steps", type=int, default=3)
  args = parser.parse_args()
  model_cfg = GPT2Config(vocab_size=args.vocab_size, seq_len=args.seq_len, num_layers=args.num_layers,
                         num_heads=args.num_heads, hidden_dim=args.hidden_dim)
  print(f"{jax.device_count()} x {jax.devices()[0].platform}; {model_cfg}; batch {args.batch_size}")
  mib = lambda n: f"{n / 2**20:9.2f}"
  print(f"{'layout':28s} {'params MiB':>10s} {'opt MiB':>9s} {'temp MiB':>9s} {'step s':>7s}")
  baseline = None
  for name, (device_mesh, sharding) in LAYOUTS.items():
    r = measure(device_mesh, sharding, model_cfg, args.batch_size, args.num_steps)
    baseline = baseline or r["params"] + r["opt_state"]
    print(f"{name:28s} {mib(r['params']):>10s} {mib(r['opt_state']):>9s} {mib(r['temp']):>9s} "
          f"{r['step_s']:7.3f}   state x{(r['params'] + r['opt_state']) / baseline:.3f}")


if __name__ == "__main__":
  main()
