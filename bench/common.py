"""Shared by the benchmarks: a compiled train step (GPT-2 or Llama) on a mesh, and its timing.

Its run is built as levanter_flax.config.settings dataclasses, with jax, flax and optax alone, so it
runs on accelerator machines without TensorFlow or ml_collections.
"""
import dataclasses
import statistics
import time

import jax
import numpy as np

from levanter_flax.optim import optimizers
from levanter_flax.parallel import partitioning
from levanter_flax.config import settings
from levanter_flax.training import step
from levanter_flax.data import DataConfig
from levanter_flax.models.gpt2 import GPT2Config
from levanter_flax.models.pipeline import PipelineConfig

OPTIMIZER = optimizers.OptimizerConfig(learning_rate=1e-3, warmup_steps=10)
DATA_PARALLEL = partitioning.ShardingConfig(tensor_axis=None)


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


def run_config(model_cfg: GPT2Config, batch_size: int, device_mesh=(("data", -1),),
               sharding: partitioning.ShardingConfig = DATA_PARALLEL,
               optimizer: optimizers.OptimizerConfig = OPTIMIZER, num_microbatches: int = 1,
               document_masking: bool = False, spike_policy: str = "none",
               pipeline: PipelineConfig = PipelineConfig()) -> settings.RunConfig:
  """A benchmark's run: the model on `device_mesh` (pipelined by `pipeline` where it has a
  stage axis), its learning rate scheduled over 1000 steps."""
  trainer = settings.TrainerConfig(batch_size=batch_size, num_train_steps=1000,
                                   device_mesh=device_mesh,
                                   gradient_accumulation_steps=num_microbatches,
                                   spike_policy=spike_policy, pipeline=pipeline)
  return settings.RunConfig(model=model_cfg, trainer=trainer, optimizer=optimizer,
                            data=DataConfig(document_masking=document_masking), sharding=sharding)


def compile_train_step(run: settings.RunConfig) -> CompiledStep:
  """The run's train step compiled for its mesh, with a random batch on the devices.

  With data.document_masking, token 0 stands for EOS: the mask costs the same wherever
  documents end.
  """
  mesh = partitioning.make_mesh(run.trainer.device_mesh, dcn_mesh=run.trainer.dcn_mesh)
  partitioner = partitioning.Partitioner(mesh, run.sharding)
  steps = step.build(run, partitioner, 0 if run.data.document_masking else None)
  tokens = np.random.default_rng(0).integers(
      0, run.model.vocab_size, (run.trainer.batch_size, run.model.seq_len), dtype=np.int32)
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
