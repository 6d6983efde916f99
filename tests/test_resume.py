"""What a resume checks and keeps: the datasets its position counts in, the config beside its
checkpoints, the batch its start chose, the skipped-step counts, and the eval of the step it
resumes at."""
import json
import logging
import os
import pathlib
import shutil
import signal
import sys

import pytest

import forkserver
from conftest import REPO, read_metrics, taken_up, write_dataset
from levanter_flax.training import batch_search
from levanter_flax.config import changes, flat_dict, to_run_config
from levanter_flax.data.manifest import PreparedDataset
from levanter_flax.core.errors import UserError
from levanter_flax.parallel.partitioning import Partitioner, make_mesh
from levanter_flax.training.resume_checks import check_resumed_config
from levanter_flax.training.restore import Progress
from levanter_flax.training.loop import train_and_evaluate
from test_eval_set import HARD
from test_main import NANO, TINY


@pytest.mark.slow
def test_a_dataset_replaced_under_the_same_path_is_refused_or_read_from_its_start(tiny_config,
                                                                                  tmp_path):
  directory = write_dataset(tmp_path / "data", HARD, HARD[:20])
  tiny_config.data.dataset = str(directory)
  tiny_config.trainer.num_train_steps = 2
  tiny_config.checkpoint.every_steps = 2
  train_and_evaluate(to_run_config(tiny_config), tmp_path / "run")
  shutil.rmtree(directory)
  write_dataset(directory, HARD[::-1], HARD[:20])  # Prepared again from other documents.
  tiny_config.trainer.num_train_steps = 4
  with pytest.raises(UserError, match=rf"^dataset {directory} is not the one the checkpoint's "
                                      rf"data position counts in \(its manifest's sha256 is \w+, "
                                      rf"was \w+\): it was prepared again or replaced.*set "
                                      rf"config.data.restart_changed_datasets=True"):
    train_and_evaluate(to_run_config(tiny_config), tmp_path / "run")
  assert [m["step"] for m in read_metrics(tmp_path / "run") if "train/loss" in m] == [1, 2]
  # Pointed at another path: the path is what changed, and the message says so.
  other = write_dataset(tmp_path / "other", HARD[1:], HARD[:20])
  tiny_config.data.dataset = str(other)
  with pytest.raises(UserError, match=rf"^dataset \w+ is now read from {other}, but the "
                                      rf"checkpoint's data position was counted in {directory}.*"
                                      rf"the path changed.*back at {directory}, or set "
                                      rf"config.data.restart_changed_datasets=True"):
    train_and_evaluate(to_run_config(tiny_config), tmp_path / "run")
  tiny_config.data.dataset = str(directory)

  tiny_config.data.restart_changed_datasets = True
  train_and_evaluate(to_run_config(tiny_config), tmp_path / "run")
  assert [m["step"] for m in read_metrics(tmp_path / "run") if "train/loss" in m] == [1, 2, 3, 4]
  # Read from its start: two steps of 8 windows of the new data, from window 0.
  assert [m["data/tokens/train"] for m in read_metrics(tmp_path / "run")
          if "data/tokens/train" in m][-1] == 2 * 8 * 64


@pytest.mark.slow
def test_checkpoints_without_their_config_are_refused_unless_told(two_steps, tiny_config, tmp_path,
                                                                   caplog):
  taken_up(two_steps, tmp_path)
  (tmp_path / "config.json").unlink()
  tiny_config.trainer.num_train_steps = 3
  tiny_config.trainer.seed = 7  # Unchecked, it would go through unnoticed.
  with pytest.raises(UserError, match=rf"^{tmp_path / 'checkpoints'} holds checkpoints \(the "
                                      rf"newest at step 2\) but {tmp_path / 'config.json'}, the "
                                      rf"config they were written with, is missing: .* set "
                                      rf"config.checkpoint.resume_without_config=True"):
    train_and_evaluate(to_run_config(tiny_config), tmp_path)
  tiny_config.checkpoint.resume_without_config = True
  with caplog.at_level(logging.WARNING):
    train_and_evaluate(to_run_config(tiny_config), tmp_path)
  assert "without the config they were written with" in caplog.text
  assert json.loads((tmp_path / "config.json").read_text())["trainer.seed"] == 7


@pytest.mark.slow
def test_a_deleted_checkpoint_directory_is_said_when_the_run_starts_over(two_steps, tiny_config,
                                                                         tmp_path, caplog):
  taken_up(two_steps, tmp_path)
  tiny_config.trainer.num_train_steps = 2
  shutil.rmtree(tmp_path / "checkpoints")
  with caplog.at_level(logging.WARNING):
    train_and_evaluate(to_run_config(tiny_config), tmp_path)
  assert (f"Starting from step 0, but {tmp_path / 'metrics.jsonl'} logged steps up to 2: no "
          f"usable checkpoint of that run is in {tmp_path / 'checkpoints'}") in caplog.text


@pytest.mark.slow
def test_skipped_step_counts_survive_a_restart(tiny_config, tmp_path):
  """A run that crash-loops on non-finite steps reaches max_consecutive_skipped_steps across its
  restarts, and its count of skipped steps goes on."""
  tiny_config.optimizer.learning_rate = 1e38  # The second update overflows float32.
  tiny_config.trainer.nan_policy = "skip"
  tiny_config.trainer.max_consecutive_skipped_steps = 4
  tiny_config.trainer.num_train_steps = 4
  tiny_config.checkpoint.every_steps = 4
  tiny_config.trainer.eval_every_steps = 100
  first = train_and_evaluate(to_run_config(tiny_config), tmp_path)["train/skipped_steps"]
  assert 2 <= first <= 3
  tiny_config.trainer.num_train_steps = 8
  with pytest.raises(UserError, match=rf"non-finite loss or gradients in 5 steps in a row, up to "
                                      rf"step {int(9 - first)}: more than"):
    train_and_evaluate(to_run_config(tiny_config), tmp_path)
  logged = {m["step"]: m["train/skipped_steps"] for m in read_metrics(tmp_path)
            if "train/skipped_steps" in m}
  assert logged[6] == first + 2  # Counted on from the checkpoint, not from 0.


def run_killed_after_checkpoint(workdir, step, *flags, run=(f"--config={NANO}", *TINY)):
  """main, killed with SIGKILL right after the checkpoint of `step` (None: not killed); `run`:
  the config's flags, by default a tiny GPT-2's."""
  return forkserver.run(
      [sys.executable, str(REPO / "tests" / "killed_after_checkpoint_main.py"), *run,
       f"--workdir={workdir}", *flags], cwd=REPO, capture_output=True, text=True,
      timeout=300, env={**os.environ, "KILL_AFTER_CHECKPOINT": str(step)})


@pytest.mark.slow
def test_an_eval_lost_to_a_kill_after_its_checkpoint_runs_on_resume(data_cache, tmp_path):
  flags = [f"--config.data.cache_dir={data_cache}", "--config.trainer.batch_size=8",
           "--config.trainer.num_train_steps=4", "--config.trainer.eval_every_steps=2",
           "--config.checkpoint.every_steps=2", "--config.data.reader_groups=1"]
  killed = run_killed_after_checkpoint(tmp_path, 2, *flags)
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
  assert not [m for m in read_metrics(tmp_path) if "eval/loss" in m]
  killed = run_killed_after_checkpoint(tmp_path, 4, *flags)  # The last step's eval is lost too.
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
  assert [m["step"] for m in read_metrics(tmp_path) if "eval/loss" in m] == [2]
  finished = run_killed_after_checkpoint(tmp_path, None, *flags)
  assert finished.returncode == 0, finished.stderr[-2000:]
  assert "Already finished" in finished.stderr
  assert [m["step"] for m in read_metrics(tmp_path) if "eval/loss" in m] == [2, 4]


def test_a_config_json_from_before_eval_tokens_is_the_same_run(tiny_config, caplog):
  """The launcher counts such a unit done, and the trainer says its evals changed."""
  now = flat_dict(to_run_config(tiny_config))
  before = {k: v for k, v in now.items() if k != "trainer.eval_tokens"} | {
      "trainer.eval_batches": 2}
  assert changes(before, now) == []
  assert changes(before | {"trainer.seed": 3}, now) == [f"trainer.seed 3 -> {now['trainer.seed']}"]
  with caplog.at_level(logging.WARNING):
    # pylint: disable-next=protected-access
    check_resumed_config(to_run_config(tiny_config), before, pathlib.Path("run"))
  assert ("The run in run started with trainer.eval_batches, which trainer.eval_tokens "
          "replaced: its evals before this resume scored another set") in caplog.text


def test_a_data_item_from_before_dataset_hashes_and_skip_counts_resumes(tmp_path, caplog):
  source = PreparedDataset("train", tmp_path, {"splits": {}}, 1.0)
  old = {"windows": 40, "per_source": {"train": 40}, "reader_groups": 1}
  progress = Progress.from_json(old)
  assert (progress.skipped_steps, progress.consecutive_skipped_steps) == (0, 0)
  with caplog.at_level(logging.WARNING):
    position = progress.position.in_datasets_of([source], restart_changed=False)
  assert position.per_source == {"train": 40}
  assert position.datasets == {"train": source.manifest_sha256}
  assert "predates dataset hashes" in caplog.text


@pytest.mark.slow
def test_an_auto_batch_is_kept_on_resume_whatever_the_search_would_now_choose(tiny_config,
                                                                              tmp_path, caplog):
  tiny_config.trainer.batch_size = "auto"
  tiny_config.trainer.num_train_steps = 2
  tiny_config.checkpoint.every_steps = 2
  run = to_run_config(tiny_config)
  partitioner = Partitioner(make_mesh(run.trainer.device_mesh), run.sharding)
  needs = {n: batch_search.step_bytes(run, partitioner, n) for n in (1, 2)}
  tiny_config.batch_search.memory_budget_bytes = needs[2]  # 2 sequences per device fit: 16.
  train_and_evaluate(to_run_config(tiny_config), tmp_path)
  tiny_config.batch_search.memory_budget_bytes = needs[1]  # A new search would choose 8.
  tiny_config.trainer.num_train_steps = 4
  with caplog.at_level(logging.WARNING):
    train_and_evaluate(to_run_config(tiny_config), tmp_path)
  saved = json.loads((tmp_path / "config.json").read_text())
  assert (saved["trainer.batch_size"], saved["trainer.gradient_accumulation_steps"]) == (16, 1)
  assert saved["batch_search.memory_budget_bytes"] == needs[1]
  tokens = {m["step"]: m["data/tokens/train"] for m in read_metrics(tmp_path)
            if "data/tokens/train" in m}
  assert tokens == {step: step * 16 * 64 for step in (1, 2, 3, 4)}
  kept = [r.getMessage() for r in caplog.records if "chose when it started" in r.getMessage()]
  assert kept == [f"Keeping the batch the run in {tmp_path} chose when it started, "
                  f"trainer.batch_size 16 and gradient_accumulation_steps 1: config.batch_search "
                  f"changed "
                  f"(batch_search.memory_budget_bytes {needs[2]} -> {needs[1]}), but a resume "
                  f"does not search again; use a new --workdir for a new search"]
