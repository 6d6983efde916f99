"""The largest microbatch that fits in memory, found by compiling, never by running out.

    python -m levanter_flax.batch_search --config=configs/gpt2_small.py [--config.x=y ...]

Each candidate per-device microbatch is compiled (on abstract arrays, so
nothing is allocated) and XLA's memory analysis gives the bytes it needs
per device: arguments + outputs - donated buffers + temporaries. Doubling
finds a bound, bisection the largest that fits the budget. The budget is
trainer.memory_fraction of the device's memory, or trainer.memory_budget_bytes
where the backend reports none (CPU). Gradient accumulation then reaches
trainer.target_batch_size. `trainer.batch_size="auto"` runs this at the
start of training.
"""
import dataclasses
from typing import Callable

import jax
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

from levanter_flax import models, optim, partitioning, step
from levanter_flax.config import RunConfig, TrainerConfig, to_run_config
from levanter_flax.errors import UserError, exit_with_error


def memory_budget(trainer: TrainerConfig, device: jax.Device) -> int:
  """Bytes per device a step may use."""
  stats = device.memory_stats() or {}
  if "bytes_limit" in stats:
    return int(stats["bytes_limit"] * trainer.memory_fraction)
  if not trainer.memory_budget_bytes:
    raise UserError(f"config.trainer.batch_size 'auto' needs config.trainer.memory_budget_bytes "
                    f"on {device.platform}, which does not report its memory")
  return trainer.memory_budget_bytes


def step_bytes(run: RunConfig, partitioner: partitioning.Partitioner, per_device: int) -> int:
  """Per-device bytes of the train step compiled for a microbatch of `per_device` sequences."""
  schedule = optim.learning_rate_schedule(run.optimizer, 1)
  steps = step.build_sharded_steps(models.build(run.model),
                                   optim.make_optimizer(run.optimizer, schedule), schedule,
                                   partitioner, run.model.seq_len)
  state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                       steps.abstract_state, steps.state_shardings)
  batch = {"tokens": jax.ShapeDtypeStruct(
      (per_device * partitioner.data_parallel_size, run.model.seq_len), np.int32,
      sharding=steps.batch_sharding)}
  with partitioner.activation_context():
    memory = steps.train_step.lower(state, batch).compile().memory_analysis()
  return (memory.argument_size_in_bytes + memory.output_size_in_bytes
          - memory.alias_size_in_bytes + memory.temp_size_in_bytes)


def largest_fitting(fits: Callable[[int], bool], limit: int) -> int:
  """The largest n in [1, limit] with fits(n), assuming fits is monotone; 0 if none."""
  if not fits(1):
    return 0
  low = 1
  while low * 2 <= limit and fits(low * 2):
    low *= 2
  high = min(low * 2, limit + 1)  # fits(high) is False or beyond the limit.
  while high - low > 1:
    middle = (low + high) // 2
    low, high = (middle, high) if fits(middle) else (low, middle)
  return low


def resolve(run: RunConfig, partitioner: partitioning.Partitioner) -> TrainerConfig:
  """The trainer config with batch_size and gradient_accumulation_steps chosen to fit."""
  trainer = run.trainer
  budget = memory_budget(trainer, jax.devices()[0])
  data_parallel = partitioner.data_parallel_size
  target = trainer.target_batch_size
  tried = {}

  def fits(per_device: int) -> bool:
    tried[per_device] = step_bytes(run, partitioner, per_device)
    logging.info("batch search: microbatch %d per device (%d global) needs %s bytes per device; "
                 "budget %s", per_device, per_device * data_parallel, f"{tried[per_device]:,}",
                 f"{budget:,}")
    return tried[per_device] <= budget
  limit = target // data_parallel if target else 4096
  per_device = largest_fitting(fits, max(limit, 1))
  if not per_device:
    raise UserError(f"not even 1 sequence per device fits the memory budget of {budget:,} bytes: "
                    f"the step needs {tried[1]:,}; use remat, ZeRO-3 (sharding.parameter_axis) "
                    f"or a larger budget")
  if not target:
    return dataclasses.replace(trainer, batch_size=per_device * data_parallel,
                               gradient_accumulation_steps=1)
  for steps in range(1, target + 1):
    microbatch, rest = divmod(target, steps)
    if not rest and microbatch % data_parallel == 0 and microbatch // data_parallel <= per_device:
      return dataclasses.replace(trainer, batch_size=target, gradient_accumulation_steps=steps)
  raise UserError(f"config.trainer.target_batch_size ({target}) cannot be split into "
                  f"microbatches of at most {per_device} per device over {data_parallel} devices")


def main(argv):
  del argv
  try:
    run = to_run_config(flags.FLAGS.config)
    partitioner = partitioning.Partitioner(partitioning.make_mesh(run.trainer.device_mesh),
                                           run.sharding)
    trainer = resolve(run, partitioner)
  except UserError as e:
    exit_with_error(str(e))
  print(f"batch_size={trainer.batch_size} gradient_accumulation_steps="
        f"{trainer.gradient_accumulation_steps}")


if __name__ == "__main__":
  # Defined only when run as a program: train.py imports this module next to main.py's flag.
  config_flags.DEFINE_config_file("config", None, "A config file in configs/.")
  flags.mark_flag_as_required("config")
  app.run(main)
