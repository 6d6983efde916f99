"""Automatic batch size: the largest microbatch under the budget, by compiled memory analysis."""
import dataclasses
import subprocess
import sys

import pytest

from conftest import REPO
from levanter_flax import batch_search
from levanter_flax.config import to_run_config
from levanter_flax.errors import UserError
from levanter_flax.partitioning import Partitioner, make_mesh
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


def test_search_finds_the_largest_microbatch_under_the_budget(run_and_partitioner):
  run, partitioner = run_and_partitioner
  needs = {n: batch_search.step_bytes(run, partitioner, n) for n in (1, 2, 3, 4)}
  assert needs[1] < needs[2] < needs[3] < needs[4]  # Activations grow with the microbatch.
  budget = (needs[3] + needs[4]) // 2
  trainer = dataclasses.replace(run.trainer, batch_size="auto", memory_budget_bytes=budget)
  resolved = batch_search.resolve(dataclasses.replace(run, trainer=trainer), partitioner)
  assert (resolved.batch_size, resolved.gradient_accumulation_steps) == (3 * 8, 1)
  # Reaching a target of 48 sequences with at most 3 per device over 8 devices: 2 x 24.
  trainer = dataclasses.replace(trainer, target_batch_size=48)
  resolved = batch_search.resolve(dataclasses.replace(run, trainer=trainer), partitioner)
  assert (resolved.batch_size, resolved.gradient_accumulation_steps) == (48, 2)


def test_budget_errors_are_named(run_and_partitioner):
  run, partitioner = run_and_partitioner
  trainer = dataclasses.replace(run.trainer, batch_size="auto")
  with pytest.raises(UserError, match="needs config.trainer.memory_budget_bytes on cpu"):
    batch_search.resolve(dataclasses.replace(run, trainer=trainer), partitioner)
  trainer = dataclasses.replace(trainer, memory_budget_bytes=1000)
  with pytest.raises(UserError, match="not even 1 sequence per device fits the memory budget of "
                                      "1,000 bytes: the step needs"):
    batch_search.resolve(dataclasses.replace(run, trainer=trainer), partitioner)


def test_command_line_prints_candidates_and_the_choice():
  result = subprocess.run(
      [sys.executable, "-m", "levanter_flax.batch_search", f"--config={NANO}", *TINY[:3],
       "--config.trainer.batch_size=auto", "--config.trainer.memory_budget_bytes=30000000",
       "--config.trainer.target_batch_size=64"],
      cwd=REPO, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "batch search: microbatch 1 per device (8 global) needs" in result.stderr
  assert result.stdout.strip().startswith("batch_size=64 gradient_accumulation_steps=")
  assert_one_line_error(subprocess.run(
      [sys.executable, "-m", "levanter_flax.batch_search", f"--config={NANO}",
       "--config.trainer.batch_size=auto"], cwd=REPO, capture_output=True, text=True, timeout=300),
      "needs config.trainer.memory_budget_bytes")
