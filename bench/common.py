"""Shared by the benchmarks: a compiled train step (GPT-2 or Llama) on a mesh, and its timing.

Uses only jax, flax and optax, so it runs on accelerator machines without
TensorFlow or ml_collections.
"""
import dataclasses
import statistics
import time

import jax
import numpy as np

from levanter_flax import models, optim, partitioning, step
from levanter_flax.models.gpt2 import GPT2Config

OPTIMIZER = optim.OptimizerConfig(learning_rate=1e-3, warmup_steps=10, weight_decay=0.1,
                                  max_grad_norm=1.0, beta1=0.9, beta2=0.95, epsilon=1e-8,
                                  min_learning_rate_ratio=0.1)
DATA_PARALLEL = partitioning.ShardingConfig(rules=(), activation_axis="data", parameter_axis=None,
                                            optimizer_axis=None, tensor_axis=None, strict=False,
                                            expert_axis=None)


@dataclasses.dataclass
class CompiledStep:
  steps: step.ShardedSteps
  compiled: object  # The AOT-compiled train step.
  state: step.TrainState
  batch: dict
  compile_seconds: float

  def step_once(self) -> float:
    """Runs one step; returns its wall time."""
    start = time.perf_counter()
    self.state, metrics = self.compiled(self.state, self.batch)
    jax.block_until_ready(metrics)
    return time.perf_counter() - start

  def median_seconds(self, num_steps: int) -> float:
    """Median wall time of `num_steps` steps, after one warm-up step."""
    self.step_once()
    return statistics.median(self.step_once() for _ in range(num_steps))


def compile_train_step(model_cfg: GPT2Config, batch_size: int, device_mesh=(("data", -1),),
                       sharding: partitioning.ShardingConfig = DATA_PARALLEL,
                       optimizer: optim.OptimizerConfig = OPTIMIZER,
                       num_microbatches: int = 1, document_masking: bool = False) -> CompiledStep:
  """The model's train step compiled for `device_mesh`, with a random batch on the devices.

  With document_masking, token 0 stands for EOS: the mask costs the same wherever documents end.
  """
  partitioner = partitioning.Partitioner(partitioning.make_mesh(device_mesh), sharding)
  schedule = optim.learning_rate_schedule(optimizer, 1000)
  steps = step.build_sharded_steps(models.build(model_cfg), optim.make_optimizer(optimizer, schedule),
                                   schedule, partitioner, num_microbatches,
                                   0 if document_masking else None)
  tokens = np.random.default_rng(0).integers(0, model_cfg.vocab_size, (batch_size, model_cfg.seq_len),
                                             dtype=np.int32)
  with partitioner.activation_context():
    state = steps.init(jax.random.key(0))
    # Each process places its own rows: this works on one process and on several.
    batch = {"tokens": jax.make_array_from_callback(tokens.shape, steps.batch_sharding,
                                                    lambda index: tokens[index])}
    start = time.perf_counter()
    compiled = steps.train_step.lower(state, batch).compile()
  return CompiledStep(steps, compiled, state, batch, time.perf_counter() - start)


def square_matmul_flops(size: int = 2048, repeats: int = 5, dtype=np.float32) -> float:
  """The best FLOP/s of a [size, size] @ [size, size] matmul on the default device."""
  a = jax.device_put(np.random.default_rng(0).standard_normal((size, size)).astype(dtype))
  matmul = jax.jit(lambda x: x @ x)
  jax.block_until_ready(matmul(a))
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(matmul(a))
    best = min(best, time.perf_counter() - start)
  return 2 * size**3 / best
