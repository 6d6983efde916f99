"""The largest microbatch that fits in memory, found by compiling, never by running out.

    python -m levanter_flax.training.batch_search --config=configs/gpt2_small.py [--config.x=y ...]

Each candidate is compiled exactly as it will run (on abstract arrays, so
nothing is allocated): its global batch, its gradient_accumulation_steps,
hence the accumulator and the stacked microbatches too. XLA's memory analysis
gives the bytes it needs per device: arguments + outputs - donated buffers +
temporaries + code. The budget is batch_search.memory_fraction of the device's memory (by
default all of a TPU's, 0.85 of another's), or
batch_search.memory_budget_bytes where the backend reports none (CPU).

Without batch_search.target_batch_size, candidates are per-device microbatches with
no accumulation: doubling finds a bound, bisection the largest that fits. With
it, candidates are the splits of the target into k equal microbatches that the
data-parallel devices share evenly, and bisection finds the smallest k that
fits. Both assume memory grows with the microbatch; whatever they return was
itself compiled and fits. `trainer.batch_size="auto"` runs this when a run first starts
(start.py); a resume keeps what it chose.
"""
import contextlib
import dataclasses
import math
import re
from typing import Callable, Optional

import jax
from absl import app, flags, logging

from levanter_flax.models import pipeline
from levanter_flax.parallel import partitioning
from levanter_flax.training import step
from levanter_flax.config import settings
from levanter_flax.config.settings import BatchSearchConfig
from levanter_flax.core.errors import UserError, exit_with_error
from levanter_flax.objectives.base import Objective


def memory_budget(search: BatchSearchConfig, device: jax.Device, capacity: int = 0) -> int:
  """Bytes per device a step may use; `capacity`: the device's memory, where it is not the
  device at hand (an ahead-of-time compile for a TPU, see plan/planner.py)."""
  if not capacity:
    capacity = (device.memory_stats() or {}).get("bytes_limit", 0)
  if capacity:
    # A TPU program's every buffer is placed when it compiles, and one that does not fit is
    # refused then; elsewhere allocators and libraries (cuDNN, NCCL) take memory the plan omits.
    fraction = search.memory_fraction or (1.0 if device.platform == "tpu" else 0.85)
    return int(capacity * fraction)
  if not search.memory_budget_bytes:
    raise UserError(f"config.trainer.batch_size 'auto' needs "
                    f"config.batch_search.memory_budget_bytes on {device.platform}, which does "
                    f"not report its memory")
  return search.memory_budget_bytes


def step_bytes(run: "settings.RunConfig", partitioner: partitioning.Partitioner, per_device: int,
               accumulation: int = 1, executables: Optional[dict] = None,
               objective: Objective = step.NEXT_TOKEN) -> int:
  """Per-device bytes of the train step as it will run: `accumulation` microbatches of `per_device`.

  Built by step.build, as loop.py builds it, so that the accumulator and the whole batch
  (per_device x data-parallel size x accumulation sequences) are counted. `objective`: what
  the run trains by (its batch entries, its reference model). `executables`: where
  given, gets the compiled step under (per_device, accumulation), for a caller that needs the
  chosen one's program (plan/planner.py) and need not compile it again.
  """
  trainer = dataclasses.replace(run.trainer, gradient_accumulation_steps=accumulation)
  # The document mask costs the same whichever token is EOS.
  steps = step.build(dataclasses.replace(run, trainer=trainer), partitioner,
                     eos_id=0 if run.data.document_masking else None, objective=objective)
  batch_size = per_device * partitioner.data_parallel_size * accumulation
  inputs = steps.abstract_inputs(batch_size)
  with partitioner.activation_context():
    lowered = steps.train_step.lower(*inputs)
  try:
    compiled = lowered.compile()
    needed = needed_bytes(compiled.memory_analysis())
    if executables is not None:
      executables[per_device, accumulation] = compiled
  except jax.errors.JaxRuntimeError as e:
    temporaries = out_of_memory_bytes(e)
    if temporaries is None:
      raise
    # The compiler names only what it needs beyond the arguments: the state is resident too.
    needed = (partitioning.per_device_bytes(steps.abstract_state, steps.state_shardings)
              + temporaries)
  if objective.reads == "rollouts":  # Its generations hold the state and the engine's cache.
    needed = max(needed, generation_bytes(run, partitioner, steps, batch_size))
  return needed


def generation_bytes(run: "settings.RunConfig", partitioner: partitioning.Partitioner,
                     steps: step.ShardedSteps, batch_size: int) -> int:
  """Per-device bytes while a generation of an objective that reads rollouts samples
  `batch_size` completions: the train state, resident meanwhile, and the engine's KV cache at
  its longest (rows of config.model.seq_len). Its decode step's temporaries (a row of logits
  per completion) are not counted."""
  from levanter_flax.generate.engine import Engine  # pylint: disable=g-import-not-at-top
  with partitioner.activation_context():
    engine = Engine(run.model, None, slots=batch_size,
                    param_shardings=steps.state_shardings.model_params,
                    batch_sharding=steps.batch_sharding)
    cache = engine.cache_bytes_per_device()
  return partitioning.per_device_bytes(steps.abstract_state, steps.state_shardings) + cache


def needed_bytes(memory) -> int:
  """What a compiled program needs per device, from its memory_analysis(): arguments + outputs -
  donated buffers + temporaries + code."""
  return (memory.argument_size_in_bytes + memory.output_size_in_bytes
          - memory.alias_size_in_bytes + memory.temp_size_in_bytes
          + memory.generated_code_size_in_bytes)


_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


# A size in XLA's errors: "15.86G", "800.0MiB", "107223594116 bytes".
_SIZE = r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B\b|\s*bytes)?"
# The forms a compiler's refusal takes, which name what the program needs and what the device
# has: "HLO temporaries (15.86G) exceeds available HBM (15.75G)" (a v5e chip's and libtpu's
# ahead-of-time compiles), "Used 21.89G of 15.75G hbm".
_REFUSED = (rf"HLO temporaries \({_SIZE}\) exceeds available HBM \({_SIZE}\)",
            rf"Used {_SIZE} of {_SIZE} hbm")
# A failed allocation as a program runs: the CPU's "Out of memory allocating 107223594116
# bytes", a TPU's "Attempting to allocate 1.20G. That was not possible. There are 800M free."
_ALLOCATING = rf"allocat\w* {_SIZE}"


def _bytes(number: str, unit: str) -> int:
  return int(float(number) * _UNITS.get(unit, 1))


def _out_of_memory(text: str) -> Optional[tuple[int, Optional[int]]]:
  """(bytes needed, bytes the device had) from the text of an error for want of device memory
  (the latter None for a failed allocation); None for any other error, a kernel's VMEM too."""
  if ("RESOURCE_EXHAUSTED" not in text
      or re.search(r"memory space (vmem|smem)", text, re.IGNORECASE)):
    return None
  for pattern in _REFUSED:
    sizes = re.search(pattern, text)
    if sizes:
      return _bytes(*sizes.group(1, 2)), _bytes(*sizes.group(3, 4))
  allocating = re.search(_ALLOCATING, text)
  if allocating and re.search("memory|allocat", text, re.IGNORECASE):
    return _bytes(*allocating.group(1, 2)), None
  return None


def out_of_memory_bytes(error: Exception) -> Optional[int]:
  """What a program needs, from the error of a compiler that refused it for want of memory
  (TPU's does: "... HLO temporaries (21.89G) exceeds available HBM"), or of an allocation that
  failed while it ran ("Out of memory allocating 107223594116 bytes", the CPU's); None for any
  other error."""
  found = _out_of_memory(str(error))
  return found and found[0]


@contextlib.contextmanager
def out_of_memory_named(trainer: settings.TrainerConfig):
  """Turns a step that does not fit its devices (refused by the compiler, or failing as it
  runs) into one line: what it needed, what was free, and what to change."""
  try:
    yield
  except Exception as e:  # pylint: disable=broad-except  # jax's runtime errors have no base.
    found = _out_of_memory(str(e))
    if found is None:
      raise
    raise UserError(out_of_memory_message(trainer, *found)) from None


def out_of_memory_message(trainer: settings.TrainerConfig, needed: int,
                          available: Optional[int]) -> str:
  microbatch = trainer.batch_size // trainer.gradient_accumulation_steps
  gib = lambda size: f"{size / 2**30:.2f} GiB"
  what = (f"it needs {gib(needed)} of device memory where {gib(available)} are free"
          if available else f"it ran out of device memory allocating {gib(needed)}")
  # The compiler's figure grows with the microbatch, but not all of it: a bound, not the answer.
  bound = (f"; at most about {microbatch * available // needed} sequences a microbatch could "
           f"fit" if available and needed > available else "")
  return (f"config.trainer.batch_size {trainer.batch_size} in microbatches of {microbatch} "
          f"sequences does not fit: {what}{bound}. Set config.trainer.batch_size=auto to find the "
          f"largest that fits, or raise config.trainer.gradient_accumulation_steps, or save memory "
          f"with config.model.compute.remat")


def _bisect(fits: Callable[[int], bool], low: int, high: int) -> int:
  """The largest n in [low, high) with fits(n), given fits(low) and that nothing from high fits."""
  while high - low > 1:
    middle = (low + high) // 2
    low, high = (middle, high) if fits(middle) else (low, middle)
  return low


def largest_fitting(fits: Callable[[int], bool], limit: int) -> int:
  """The largest n in [1, limit] with fits(n), assuming fits is monotone; 0 if none."""
  if not fits(1):
    return 0
  low = 1
  while low * 2 <= limit and fits(low * 2):
    low *= 2
  return _bisect(fits, low, min(low * 2, limit + 1))  # fits(low * 2) is False or beyond the limit.


def microbatch_choices(target: int, data_parallel: int) -> list[int]:
  """Per-device microbatches that split `target` into equal microbatches, ascending.

  k microbatches of target / k sequences each need k | target and
  data_parallel | target / k: exactly the divisors of target / data_parallel.
  """
  if target % data_parallel:
    raise UserError(f"config.batch_search.target_batch_size ({target}) must be divisible by the "
                    f"activation axis size ({data_parallel})")
  per_device_total = target // data_parallel
  return [n for n in range(1, per_device_total + 1) if not per_device_total % n]


def smallest_fitting_accumulation(fits: Callable[[int, int], bool], target: int,
                                  data_parallel: int) -> tuple[int, int]:
  """(per-device microbatch, accumulation steps) that reach `target` in the fewest steps that fit.

  Every choice is tried with the accumulation it will run with. Bisection over
  the choices: 1 + ceil(log2(choices)) calls of fits. (0, 0) if none fits.
  """
  choices = microbatch_choices(target, data_parallel)
  accumulation = lambda i: target // (choices[i] * data_parallel)
  fits_choice = lambda i: fits(choices[i], accumulation(i))
  if not fits_choice(0):
    return 0, 0
  best = _bisect(fits_choice, 0, len(choices))
  return choices[best], accumulation(best)


def resolve(run: "settings.RunConfig", partitioner: partitioning.Partitioner,
            capacity: int = 0, executables: Optional[dict] = None,
            objective: Objective = step.NEXT_TOKEN) -> "settings.TrainerConfig":
  """The trainer config with batch_size and gradient_accumulation_steps chosen to fit the
  partitioner's devices (of `capacity` bytes each, where they cannot say). `executables` and
  `objective`: step_bytes'."""
  trainer, search = run.trainer, run.batch_search
  if partitioner.logical_axis_size(pipeline.LAYERS) > 1:
    raise UserError("config.trainer.batch_size=auto does not search a pipelined run's batch "
                    "(trainer.device_mesh has stages); set trainer.batch_size and "
                    "trainer.pipeline.microbatches")
  budget = memory_budget(search, partitioner.mesh.devices.flat[0], capacity)
  data_parallel = partitioner.data_parallel_size
  needs = {}

  def fits(per_device: int, accumulation: int) -> bool:
    needs[per_device] = step_bytes(run, partitioner, per_device, accumulation, executables,
                                   objective)
    logging.info("batch search: microbatch %d per device (%d global) needs %s bytes per device "
                 "with gradient_accumulation_steps=%d (%d sequences per step); budget %s",
                 per_device, per_device * data_parallel, f"{needs[per_device]:,}", accumulation,
                 per_device * data_parallel * accumulation, f"{budget:,}")
    return needs[per_device] <= budget

  multiple = objective.batch_multiple
  if search.target_batch_size:
    if search.target_batch_size % multiple:
      raise UserError(f"config.batch_search.target_batch_size ({search.target_batch_size}) must "
                      f"be a multiple of {multiple}, the rows of one group (config.rl.group_size)")
    per_device, accumulation = smallest_fitting_accumulation(fits, search.target_batch_size,
                                                             data_parallel)
  else:
    # Per-device microbatches whose global batch is a multiple of `multiple`.
    unit = multiple // math.gcd(multiple, data_parallel)
    per_device, accumulation = unit * largest_fitting(lambda n: fits(unit * n, 1),
                                                      4096 // unit), 1
  if not per_device:
    smallest = min(needs)
    raise UserError(f"not even {smallest} sequence(s) per device fit the memory budget of "
                    f"{budget:,} bytes: the step needs {needs[smallest]:,}; use remat, ZeRO-3 "
                    f"(sharding.parameter_axis) or a larger budget")
  return dataclasses.replace(trainer, batch_size=per_device * data_parallel * accumulation,
                             gradient_accumulation_steps=accumulation)


def main(argv):
  del argv
  # pylint: disable-next=g-import-not-at-top  # config.py imports this module.
  from levanter_flax.config import run_config_of_flags
  try:
    run = run_config_of_flags()
    mesh = partitioning.make_mesh(run.trainer.device_mesh, dcn_mesh=run.trainer.dcn_mesh)
    partitioner = partitioning.Partitioner(mesh, run.sharding)
    trainer = resolve(run, partitioner)
  except UserError as e:
    exit_with_error(str(e))
  print(f"batch_size={trainer.batch_size} gradient_accumulation_steps="
        f"{trainer.gradient_accumulation_steps}")


if __name__ == "__main__":
  # Defined only when run as a program: loop.py imports this module next to the train command's
  # flag.
  # pylint: disable-next=g-import-not-at-top  # config.py imports this module.
  from levanter_flax.config import define_config_flag, parse_flags
  define_config_flag("A config file, or a shipped config's name (gpt2_nano, gpt2:nano).")
  flags.mark_flag_as_required("config")
  app.run(main, flags_parser=parse_flags)
