"""Automatic batch size: the largest microbatch under the budget, by compiled memory analysis."""
import dataclasses
import math
import re
import sys

import pytest

import forkserver
from conftest import REPO, load_config_file
from levanter_flax.training import batch_search, step
from levanter_flax.config import settings, to_run_config
from levanter_flax.core.errors import UserError
from levanter_flax.parallel.partitioning import Partitioner, make_mesh
from test_main import NANO, TINY, assert_one_line_error


@pytest.fixture(scope="module")
def run_and_partitioner():
  from conftest import load_config_file
  config = load_config_file("gpt2_nano")
  config.model.seq_len = 64
  config.model.num_layers = 1
  config.model.hidden_dim = 64
  run = to_run_config(config)
  return run, Partitioner(make_mesh(run.trainer.device_mesh), run.sharding)


def test_largest_fitting_is_exact_for_every_threshold():
  for threshold in range(0, 40):
    assert batch_search.largest_fitting(lambda n: n <= threshold, 37) == min(threshold, 37)


@pytest.mark.slow
def test_search_finds_the_largest_microbatch_under_the_budget(run_and_partitioner):
  run, partitioner = run_and_partitioner
  needs = {n: batch_search.step_bytes(run, partitioner, n) for n in (1, 2, 3, 4)}
  assert needs[1] < needs[2] < needs[3] < needs[4]  # Activations grow with the microbatch.
  budget = (needs[3] + needs[4]) // 2
  trainer = dataclasses.replace(run.trainer, batch_size="auto")
  search = dataclasses.replace(run.batch_search, memory_budget_bytes=budget)
  resolved = batch_search.resolve(dataclasses.replace(run, trainer=trainer, batch_search=search),
                                  partitioner)
  assert (resolved.batch_size, resolved.gradient_accumulation_steps) == (3 * 8, 1)


def test_accumulation_search_tries_only_real_splits_and_is_exact():
  for target in (8, 48, 56, 64, 96):
    choices = batch_search.microbatch_choices(target, 8)
    for threshold in range(0, target // 8 + 2):
      tried = []

      def fits(per_device, accumulation, threshold=threshold, tried=tried):
        tried.append((per_device, accumulation))
        return per_device <= threshold
      found = batch_search.smallest_fitting_accumulation(fits, target, 8)
      # Each compile is a configuration the run could use: the whole target in equal microbatches.
      assert all(n * 8 * k == target for n, k in tried), (target, tried)
      assert len(tried) <= 1 + math.ceil(math.log2(len(choices)))
      best = max((n for n in choices if n <= threshold), default=0)
      assert found == ((best, target // (8 * best)) if best else (0, 0)), (target, threshold)
  with pytest.raises(UserError, match=r"^config.batch_search.target_batch_size \(12\) must be divisible "
                                      r"by the activation axis size \(8\)$"):
    batch_search.smallest_fitting_accumulation(lambda n, k: True, 12, 8)


def compiled_bytes(run, partitioner, per_device: int, accumulation: int) -> int:
  """The real step's per-device bytes: the run as resolve would return it, built and compiled as
  loop.py does, not by step_bytes."""
  batch_size = per_device * partitioner.data_parallel_size * accumulation
  trainer = dataclasses.replace(run.trainer, batch_size=batch_size,
                                gradient_accumulation_steps=accumulation)
  steps = step.build(dataclasses.replace(run, trainer=trainer), partitioner)
  with partitioner.activation_context():
    memory = steps.train_step.lower(*steps.abstract_inputs(batch_size)).compile().memory_analysis()
  return (memory.argument_size_in_bytes + memory.output_size_in_bytes
          - memory.alias_size_in_bytes + memory.temp_size_in_bytes)


@pytest.mark.slow
def test_target_search_counts_the_accumulation_the_step_will_run(run_and_partitioner):
  run, partitioner = run_and_partitioner
  # A target of 48 over 8 devices: 1, 2, 3 or 6 per device in 6, 3, 2 or 1 microbatches.
  two_by_three = compiled_bytes(run, partitioner, 2, 3)
  three_by_two = compiled_bytes(run, partitioner, 3, 2)
  three_alone = compiled_bytes(run, partitioner, 3, 1)
  budget = (max(two_by_three, three_alone) + three_by_two) // 2
  # Compiled without accumulation, 3 per device fits, so a search that leaves the
  # accumulator out would run 3 x 2, which does not; 2 x 3 is the largest that fits.
  assert two_by_three <= budget < three_by_two, (two_by_three, budget, three_by_two)
  assert three_alone <= budget, (three_alone, budget)
  trainer = dataclasses.replace(run.trainer, batch_size="auto")
  search = dataclasses.replace(run.batch_search, memory_budget_bytes=budget, target_batch_size=48)
  resolved = batch_search.resolve(dataclasses.replace(run, trainer=trainer, batch_search=search),
                                  partitioner)
  assert (resolved.batch_size, resolved.gradient_accumulation_steps) == (48, 3)


class _Device:
  """A device as memory_budget reads one: its platform and what memory_stats reports."""

  def __init__(self, platform: str, bytes_limit: int):
    self.platform, self._stats = platform, {"bytes_limit": bytes_limit}

  def memory_stats(self):
    return self._stats


def test_the_budget_is_all_of_a_tpus_memory_and_most_of_a_gpus_unless_set():
  default = settings.BatchSearchConfig()
  # A v5e chip's bytes_limit, read on the chip: its compiler refuses a program past it.
  assert batch_search.memory_budget(default, _Device("tpu", 16_909_336_064)) == 16_909_336_064
  assert batch_search.memory_budget(default, _Device("gpu", 80 << 30)) == int(0.85 * (80 << 30))
  half = dataclasses.replace(default, memory_fraction=0.5)
  assert batch_search.memory_budget(half, _Device("tpu", 1000)) == 500
  assert batch_search.memory_budget(half, _Device("cpu", 0), capacity=1000) == 500


def test_budget_errors_are_named(run_and_partitioner):
  run, partitioner = run_and_partitioner
  trainer = dataclasses.replace(run.trainer, batch_size="auto")
  with pytest.raises(UserError, match="needs config.batch_search.memory_budget_bytes on cpu"):
    batch_search.resolve(dataclasses.replace(run, trainer=trainer), partitioner)
  search = dataclasses.replace(run.batch_search, memory_budget_bytes=1000)
  with pytest.raises(UserError, match="not even 1 sequence\\(s\\) per device fit the memory budget of "
                                      "1,000 bytes: the step needs"):
    batch_search.resolve(dataclasses.replace(run, trainer=trainer, batch_search=search),
                         partitioner)


@pytest.mark.slow
def test_command_line_prints_candidates_and_the_choice():
  result = forkserver.run(
      [sys.executable, "-m", "levanter_flax.training.batch_search", f"--config={NANO}", *TINY[:3],
       "--config.trainer.batch_size=auto", "--config.batch_search.memory_budget_bytes=30000000",
       "--config.batch_search.target_batch_size=64"],
      cwd=REPO, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "batch search: microbatch 1 per device (8 global) needs" in result.stderr
  assert result.stdout.strip().startswith("batch_size=64 gradient_accumulation_steps=")
  assert_one_line_error(forkserver.run(
      [sys.executable, "-m", "levanter_flax.training.batch_search", f"--config={NANO}",
       "--config.trainer.batch_size=auto"], cwd=REPO, capture_output=True, text=True, timeout=300),
      "needs config.batch_search.memory_budget_bytes")


def test_a_generation_counts_the_state_and_the_engines_cache(run_and_partitioner):
  """GRPO's engine holds keys and values for every completion at the model's seq_len, split
  over the data axis, and each completion's tokens and logit bias, beside the train state."""
  from levanter_flax.generate.engine import MAX_LOGIT_BIAS
  from levanter_flax.objectives import grpo
  from levanter_flax.parallel.partitioning import per_device_bytes
  run, partitioner = run_and_partitioner
  steps = step.build(run, partitioner, objective=grpo.Grpo(grpo.GrpoConfig(group_size=16)))
  cfg, devices = run.model, partitioner.mesh.size
  keys_and_values = 2 * cfg.num_layers * 32 * cfg.seq_len * cfg.hidden_dim * 4 // devices
  positions = cfg.num_layers * 32 * 4 // devices  # An int32 per slot and layer.
  sampled = 32 * (cfg.seq_len + 2 * MAX_LOGIT_BIAS + 2) * 4  # Replicated: tokens, bias, penalties.
  assert batch_search.generation_bytes(run, partitioner, steps, 32) == (
      per_device_bytes(steps.abstract_state, steps.state_shardings) + keys_and_values + positions
      + sampled)


@pytest.mark.slow
def test_a_grpo_search_keeps_whole_groups(run_and_partitioner):
  """Groups of 16 on 8 devices: the per-device microbatch is even."""
  from levanter_flax.objectives import grpo
  run, partitioner = run_and_partitioner
  needs = {n: batch_search.step_bytes(run, partitioner, n) for n in (3, 4)}
  trainer = dataclasses.replace(run.trainer, batch_size="auto")
  search = dataclasses.replace(run.batch_search, memory_budget_bytes=(needs[3] + needs[4]) // 2)
  searched = dataclasses.replace(run, trainer=trainer, batch_search=search)
  assert batch_search.resolve(searched, partitioner).batch_size == 24
  objective = grpo.Grpo(grpo.GrpoConfig(group_size=16))
  assert batch_search.resolve(searched, partitioner, objective=objective).batch_size == 16
  with pytest.raises(UserError, match=r"target_batch_size \(24\) must be a multiple of 16"):
    batch_search.resolve(dataclasses.replace(searched, batch_search=dataclasses.replace(
        search, target_batch_size=24)), partitioner, objective=objective)


# The errors of a step that does not fit, as XLA words them: a TPU v5e chip's compiler (seen on
# the chip, gpt2.py:small_fast at 32 sequences a microbatch), the form planner.py's
# ahead-of-time compiles meet, and failed allocations as a program runs, on a CPU and on a TPU.
@pytest.mark.parametrize("error, line", [
    ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
     "temporaries (15.86G) exceeds available HBM (15.75G).",
     "it needs 15.86 GiB of device memory where 15.75 GiB are free; at most about 31 sequences "
     "a microbatch could fit."),
    ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space "
     "hbm. Used 21.89G of 15.48G hbm. Exceeded hbm capacity by 6.41G.",
     "it needs 21.89 GiB of device memory where 15.48 GiB are free; at most about 22 sequences "
     "a microbatch could fit."),
    ("RESOURCE_EXHAUSTED: Out of memory allocating 107223594116 bytes.",
     "it ran out of device memory allocating 99.86 GiB."),
    ("RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate 1.20G. That was "
     "not possible. There are 800M free.",
     "it ran out of device memory allocating 1.20 GiB."),
    ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 16.00GiB.",
     "it ran out of device memory allocating 16.00 GiB."),
])
def test_a_step_that_does_not_fit_is_one_line_with_its_figures(error, line):
  trainer = dataclasses.replace(to_run_config(load_config_file("gpt2_nano")).trainer, batch_size=64,
                                gradient_accumulation_steps=2)
  with pytest.raises(UserError) as raised:
    with batch_search.out_of_memory_named(trainer):
      raise RuntimeError(error)
  assert str(raised.value) == (
      f"config.trainer.batch_size 64 in microbatches of 32 sequences does not fit: {line} Set "
      "config.trainer.batch_size=auto to find the largest that fits, or raise "
      "config.trainer.gradient_accumulation_steps, or save memory with config.model.compute.remat")


def test_other_errors_of_a_step_pass_through():
  trainer = to_run_config(load_config_file("gpt2_nano")).trainer
  for error in ("RESOURCE_EXHAUSTED: quota exceeded for bucket", "INTERNAL: core halted",
                # A kernel's scratch memory: its blocks, not the batch, are what to change.
                "RESOURCE_EXHAUSTED: Ran out of memory in memory space vmem. Used 20.50M of "
                "16.00M vmem."):
    with pytest.raises(RuntimeError, match=re.escape(error)):
      with batch_search.out_of_memory_named(trainer):
        raise RuntimeError(error)
