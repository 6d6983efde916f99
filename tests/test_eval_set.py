"""The eval set: spread over the whole validation split, and defined by the data and its size
alone, never by the batch layout, the reader groups or the process count."""
import dataclasses
import logging
import pathlib

import jax
import numpy as np
import pytest

from conftest import read_metrics, write_dataset
from etils import epath

from levanter_flax import models
from levanter_flax.parallel import partitioning
from levanter_flax.training import step
from levanter_flax.generate.trained import run_params
from levanter_flax.config import mesh, to_run_config
from levanter_flax.data import eval_set
from levanter_flax.data.manifest import PreparedDataset, load_manifest
from levanter_flax.core.errors import UserError
from levanter_flax.training.loop import _make_evaluate, train_and_evaluate  # pylint: disable=protected-access


def source_of(directory: pathlib.Path) -> PreparedDataset:
  return PreparedDataset("train", directory, load_manifest(directory), 1.0)


# Easy documents repeat one phrase; hard ones are random letters, which no model predicts.
EASY = "abcd" * 48
RNG = np.random.default_rng(0)
HARD = ["".join(RNG.choice(list("abcdefghijklmnopqrstuvwxyz "), size=len(EASY)))
        for _ in range(100)]


@pytest.mark.slow
def test_a_sampled_eval_scores_what_the_whole_split_does_not_its_first_documents(tiny_config, tmp_path):
  """Validation easy first, hard last: 40 of its ~350 windows, spread, score what all of them do.
  The first 40 alone (the eval before this one) would score the easy half only."""
  directory = write_dataset(tmp_path / "data", [EASY] * 100 + HARD, [EASY] * 100 + HARD)
  tiny_config.data.dataset = str(directory)
  tiny_config.model.seq_len = 32
  tiny_config.trainer.num_train_steps = 40
  tiny_config.trainer.eval_every_steps = 40
  tiny_config.trainer.log_every_steps = 40
  tiny_config.trainer.eval_tokens = 40 * 32
  tiny_config.optimizer.learning_rate = 1e-2
  train_and_evaluate(to_run_config(tiny_config), tmp_path / "run")
  sampled = [m for m in read_metrics(tmp_path / "run") if "eval/loss" in m][-1]
  assert sampled["eval/tokens"] == 40 * 31

  model_cfg, params, _ = run_params(epath.Path(tmp_path / "run"))
  eval_step = jax.jit(step.make_eval_step(models.build(model_cfg), eos_id=256))
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  whole = eval_set.build(source_of(directory), seq_len=32, eval_tokens="all",
                         vocab_size=model_cfg.vocab_size, process_index=0, process_count=1)
  whole_loss, _, _ = eval_set.evaluate(whole, eval_step, params, 8, device)
  first = dataclasses.replace(whole, num_windows=40, windows=whole.windows[:40])
  first_loss, _, _ = eval_set.evaluate(first, eval_step, params, 8, device)
  assert abs(sampled["eval/loss"] - whole_loss) < 3 * sampled["eval/loss_stderr"]
  assert abs(sampled["eval/loss"] - whole_loss) < 0.1 * whole_loss
  assert whole_loss - first_loss > 0.5  # What reading the split in file order got wrong.


@pytest.mark.slow
def test_eval_loss_of_the_same_params_does_not_depend_on_the_batch_layout(tiny_config, tmp_path):
  """Batch sizes 8/16, accumulation 1/2, reader groups 1/4: one eval set, one loss."""
  directory = write_dataset(tmp_path / "data", HARD, [EASY] * 30 + HARD[:30], num_shards=4)
  tiny_config.data.dataset = str(directory)
  tiny_config.trainer.eval_tokens = 20 * 64  # 20 of 46 windows: two and a half batches of 8.
  tiny_config.trainer.device_mesh = mesh(data=4, model=-1)
  losses = {}
  for batch_size, accumulation, reader_groups in ((8, 1, 1), (8, 2, 4), (16, 1, 4), (16, 2, 1)):
    tiny_config.trainer.batch_size = batch_size
    tiny_config.trainer.gradient_accumulation_steps = accumulation
    tiny_config.data.reader_groups = reader_groups
    run = to_run_config(tiny_config)
    partitioner = partitioning.Partitioner(partitioning.make_mesh(run.trainer.device_mesh),
                                           run.sharding)
    steps = step.build(run, partitioner, eos_id=256)
    with partitioner.activation_context():
      state = steps.init(jax.random.key(0))
      evaluate = _make_evaluate(run, steps, [source_of(directory)])
      losses[batch_size, accumulation, reader_groups] = evaluate(state)
  first = next(iter(losses.values()))
  assert first["eval/tokens"] == 20 * 63
  for layout, metrics in losses.items():
    assert metrics["eval/loss"] == pytest.approx(first["eval/loss"], rel=1e-6), layout
    assert metrics["eval/loss_stderr"] == pytest.approx(first["eval/loss_stderr"], rel=1e-4), layout


def test_the_shares_of_several_processes_make_the_whole_set_once():
  """Each process's rows of every global batch, the padding left out, are the set, each window
  once, wherever the mesh puts a process's rows: 7 windows over 2 processes, process 1's rows
  first in each batch of 4; over 3 processes of one row; over 1."""
  windows = np.arange(7)[:, None] * np.ones((1, 3), np.int32)
  for layout in ([[2, 3], [0, 1]], [[1], [2], [0]], [[0, 1, 2, 3]]):
    process_rows = [np.array(rows) for rows in layout]
    shares = np.array_split(windows, len(layout))
    sets = [eval_set.EvalSet(None, 7, share, i, len(layout)) for i, share in enumerate(shares)]
    rows_per_process = len(layout[0])
    global_rows = []
    for parts in zip(*[s.local_batches(rows_per_process) for s in sets]):
      batch = np.zeros((rows_per_process * len(layout), 3), np.int32)
      for part, rows in zip(parts, process_rows):
        batch[rows] = part["tokens"]
      global_rows.append(batch)
    scored = np.concatenate(global_rows)[sets[0].scored(process_rows)]
    assert sorted(scored[:, 0]) == list(range(7)), layout
    assert all(np.array_equal(s.scored(process_rows), sets[0].scored(process_rows)) for s in sets)


def test_each_processs_rows_are_where_the_mesh_puts_its_devices():
  """One process here: every row of the batch is its, in order, whatever the mesh."""
  for axes in (("data",), ("data", "model")):
    devices = np.array(jax.devices()).reshape((8,) if len(axes) == 1 else (4, 2))
    sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(devices, axes),
                                          jax.sharding.PartitionSpec("data"))
    assert [list(r) for r in eval_set.process_rows(sharding, 16, 1)] == [list(range(16))]


@pytest.mark.slow
def test_one_validation_document_and_eight_reader_groups_evaluate(tiny_config, tmp_path):
  directory = write_dataset(tmp_path / "data", HARD[:40], [HARD[50]], num_shards=8)
  tiny_config.data.dataset = str(directory)
  tiny_config.data.reader_groups = 8
  tiny_config.model.seq_len = 32
  tiny_config.trainer.num_train_steps = 2
  tiny_config.trainer.eval_every_steps = 2
  train_and_evaluate(to_run_config(tiny_config), tmp_path / "run")
  evals = [m for m in read_metrics(tmp_path / "run") if "eval/loss" in m]
  assert [m["step"] for m in evals] == [2]
  assert evals[0]["eval/tokens"] == len(HARD[50]) // 32 * 31  # One document: all it holds.


def test_a_split_without_a_whole_window_is_refused_before_training(tiny_config, tmp_path):
  directory = write_dataset(tmp_path / "data", HARD, ["too short"])
  tiny_config.data.dataset = str(directory)
  with pytest.raises(UserError, match=r"^the validation split of .*data holds 10 tokens \(EOS "
                                      r"included\), less than one window of config.model.seq_len "
                                      r"64: nothing to evaluate"):
    train_and_evaluate(to_run_config(tiny_config), tmp_path / "run")
  assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_more_than_the_split_is_all_of_it_with_one_warning(tmp_path, caplog):
  source = source_of(write_dataset(tmp_path / "data", HARD, HARD[:10]))
  available = (10 * (len(EASY) + 1)) // 16
  with caplog.at_level(logging.WARNING):
    built = eval_set.build(source, seq_len=16, eval_tokens=10**9, vocab_size=257,
                           process_index=0, process_count=1)
  assert built.num_windows == len(built.windows) == available
  assert [r.getMessage() for r in caplog.records if "eval_tokens" in r.getMessage()] == [
      f"config.trainer.eval_tokens 1000000000 is more than the validation split of "
      f"{source.directory} holds in 16-token windows ({available * 16}); evaluating on all of it"]
  assert eval_set.num_windows(source, 16, "all") == available
  assert eval_set.num_windows(source, 16, 17) == 2  # Whole windows, rounded up.
  assert list(eval_set.spread(10, 4)) == [1, 3, 6, 8]
  assert list(eval_set.spread(5, 5)) == [0, 1, 2, 3, 4]


@pytest.mark.slow
def test_a_long_eval_on_a_cpu_split_into_devices_does_not_deadlock(tiny_config, tmp_path):
  """Hundreds of eval batches on the 8 fake devices of 2 cores: dispatched all at once, their
  all-gathers starved XLA:CPU's thread pool until its rendezvous aborted the process."""
  tiny_config.trainer.num_train_steps = 1
  tiny_config.trainer.eval_tokens = 256 * 8 * 64
  run = to_run_config(tiny_config)
  final = train_and_evaluate(run, epath.Path(tmp_path / "run"))
  assert final["eval/tokens"] == 256 * 8 * 63 and np.isfinite(final["eval/loss"])
