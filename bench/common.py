"""Shared by the benchmarks: a compiled GPT-2 train step on a mesh, and its timing.

Uses only jax, flax and optax, so it runs on accelerator machines without
TensorFlow or ml_collections.
"""
import dataclasses
import statistics
import time

import jax
import numpy as np

from levanter_flax import optim, partitioning, step
from levanter_flax.models.gpt2 import GPT2Config, GPT2LMHeadModel

OPTIMIZER = optim.OptimizerConfig(learning_rate=1e-3, warmup_steps=10, weight_decay=0.1,
                                  max_grad_norm=1.0, beta1=0.9, beta2=0.95, epsilon=1e-8,
                                  min_learning_rate_ratio=0.1)
DATA_PARALLEL = partitioning.ShardingConfig(rules=(), activation_axis="data", parameter_axis=None,
                                            optimizer_axis=None, tensor_axis=None, strict=False)


@dataclasses.dataclass
class CompiledStep:
  steps: step.ShardedSteps
  compiled: object  # The AOT-compiled train step.
  state: step.TrainState
  batch: dict

  def median_seconds(self, num_steps: int) -> float:
    """Median wall time of `num_steps` steps, after one warm-up step."""
    times = []
    for _ in range(num_steps + 1):
      start = time.perf_counter()
      self.state, metrics = self.compiled(self.state, self.batch)
      jax.block_until_ready(metrics)
      times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def compile_train_step(model_cfg: GPT2Config, batch_size: int, device_mesh=(("data", -1),),
                       sharding: partitioning.ShardingConfig = DATA_PARALLEL) -> CompiledStep:
  """GPT-2's train step compiled for `device_mesh`, with a random batch on the devices."""
  partitioner = partitioning.Partitioner(partitioning.make_mesh(device_mesh), sharding)
  schedule = optim.learning_rate_schedule(OPTIMIZER, 1000)
  steps = step.build_sharded_steps(GPT2LMHeadModel(model_cfg), optim.make_optimizer(OPTIMIZER, schedule),
                                   schedule, partitioner, model_cfg.seq_len)
  tokens = np.random.default_rng(0).integers(0, model_cfg.vocab_size, (batch_size, model_cfg.seq_len))
  with partitioner.activation_context():
    state = steps.init(jax.random.key(0))
    batch = {"tokens": jax.device_put(tokens.astype(np.int32), steps.batch_sharding)}
    compiled = steps.train_step.lower(state, batch).compile()
  return CompiledStep(steps, compiled, state, batch)
