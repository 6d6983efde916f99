"""The eval set: spread over the whole validation split, and defined by the data and its size
alone, never by the batch layout, the reader groups or the process count."""
import dataclasses
import logging
import pathlib

import jax
import numpy as np
import optax
import pytest

from conftest import read_metrics, write_dataset
from etils import epath

from levanter_flax import models, partitioning, step, train
from levanter_flax.checkpoint import run_params
from levanter_flax.config import mesh, to_run_config
from levanter_flax.data import eval_set, loader, prepare
from levanter_flax.errors import UserError
from levanter_flax.train import train_and_evaluate


def source_of(directory: pathlib.Path) -> loader.Source:
  return loader.Source("train", directory, prepare.load_manifest(directory), 1.0)


# Easy documents repeat one phrase; hard ones are random letters, which no model predicts.
EASY = "abcd" * 48
RNG = np.random.default_rng(0)
HARD = ["".join(RNG.choice(list("abcdefghijklmnopqrstuvwxyz "), size=len(EASY)))
        for _ in range(100)]


def test_the_default_eval_scores_the_whole_split_not_its_first_documents(tiny_config, tmp_path):
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
  whole_loss, whole_stderr = eval_set.evaluate(whole, eval_step, params, 8, device)
  first = dataclasses.replace(whole, num_windows=40, windows=whole.windows[:40])
  first_loss, _ = eval_set.evaluate(first, eval_step, params, 8, device)
  assert abs(sampled["eval/loss"] - whole_loss) < 3 * sampled["eval/loss_stderr"]
  assert abs(sampled["eval/loss"] - whole_loss) < 0.1 * whole_loss
  assert whole_loss - first_loss > 0.5  # What reading the split in file order got wrong.
  assert whole_stderr < sampled["eval/loss_stderr"]


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
    steps = step.build_sharded_steps(models.build(run.model), optax.sgd(0.0), lambda _: 0.0,
                                     partitioner, accumulation, eos_id=256)
    with partitioner.activation_context():
      params = steps.init(jax.random.key(0)).params
      evaluate = train._make_evaluate(run, steps, [source_of(directory)])  # pylint: disable=protected-access
      losses[batch_size, accumulation, reader_groups] = evaluate(params)
  first = next(iter(losses.values()))
  assert first["eval/tokens"] == 20 * 63
  for layout, metrics in losses.items():
    assert metrics["eval/loss"] == pytest.approx(first["eval/loss"], rel=1e-6), layout
    assert metrics["eval/loss_stderr"] == pytest.approx(first["eval/loss_stderr"], rel=1e-4), layout


def test_the_shares_of_several_processes_make_the_whole_set_once():
  """Each process's rows of every global batch, the padding left out, are the set, each window
  once: 7 windows over 2 processes in batches of 4 (2 rows each), then 3 processes of 1 row."""
  windows = np.arange(7)[:, None] * np.ones((1, 3), np.int32)
  for process_count, batch_size in ((2, 4), (3, 3), (1, 4)):
    shares = np.array_split(windows, process_count)
    sets = [eval_set.EvalSet(None, 7, share, i, process_count) for i, share in enumerate(shares)]
    batches = zip(*[s.local_batches(batch_size) for s in sets])
    rows = np.concatenate([np.concatenate([b["tokens"] for b in parts]) for parts in batches])
    scored = rows[sets[0].scored(batch_size)]
    assert sorted(scored[:, 0]) == list(range(7)), process_count
    assert all(np.array_equal(s.scored(batch_size), sets[0].scored(batch_size)) for s in sets)


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
    assert eval_set.num_windows(source, 16, 10**9) == available
  assert [r.getMessage() for r in caplog.records if "eval_tokens" in r.getMessage()] == [
      f"config.trainer.eval_tokens 1000000000 is more than the validation split of "
      f"{source.directory} holds in 16-token windows ({available * 16}); evaluating on all of it"]
  assert eval_set.num_windows(source, 16, "all") == available
  assert eval_set.num_windows(source, 16, 17) == 2  # Whole windows, rounded up.
  assert list(eval_set.spread(10, 4)) == [1, 3, 6, 8]
  assert list(eval_set.spread(5, 5)) == [0, 1, 2, 3, 4]
