"""The training loop on the built-in corpus: loss falls, resume is exact, errors are named."""
import json

import numpy as np
import pytest

from conftest import as_at_checkpoint, prepare_texts, random_documents, read_metrics, train_losses
from levanter_flax.config import mesh, to_run_config
from levanter_flax.core.errors import UserError
from levanter_flax.training.loop import train_and_evaluate


@pytest.mark.slow
def test_loss_falls_on_nano(tiny_config, tmp_path):
  tiny_config.trainer.num_train_steps = 40
  tiny_config.trainer.eval_every_steps = 40
  final = train_and_evaluate(to_run_config(tiny_config), tmp_path)
  losses = train_losses(tmp_path)
  assert sorted(losses) == list(range(1, 41))
  # Uniform guessing over 384 ids is ln(384) = 5.95; bytes of Python are far easier.
  assert losses[1] > 5.0
  assert np.mean([losses[s] for s in range(36, 41)]) < losses[1] - 2.0
  assert final["eval/loss"] < losses[1] - 2.0
  logged = read_metrics(tmp_path)[-1]
  assert {"train/learning_rate", "train/grad_norm", "train/tokens_per_second",
          "train/data_wait_seconds", "train/steps_in_flight", "eval/perplexity",
          "eval/bits_per_byte"} <= set(
      k for m in read_metrics(tmp_path) for k in m)
  assert logged["step"] == 40
  # Bytes are tokens here, so bits per byte is the loss in bits, give or take the EOS tokens.
  assert final["eval/bits_per_byte"] == pytest.approx(final["eval/loss"] / np.log(2), rel=0.02)
  assert final["data/tokens/train"] == 40 * 8 * 64


@pytest.fixture(scope="module")
def prose_dataset(tmp_path_factory):
  return prepare_texts(tmp_path_factory.mktemp("prose"), random_documents(60))


@pytest.mark.slow
@pytest.mark.parametrize("mixture", [False, True])
def test_resume_continues_exactly(tiny_config, tmp_path, prose_dataset, mixture):
  """Stopping at step 5 and running again gives the losses of one uninterrupted run."""
  tiny_config.data.reader_groups = 0  # The default: chosen when the run first starts.
  if mixture:
    tiny_config.data.mixture.code = dict(dataset="stdlib", weight=3.0)
    tiny_config.data.mixture.prose = dict(dataset=str(prose_dataset), weight=1.0)
  straight = tmp_path / "straight"
  train_and_evaluate(to_run_config(tiny_config), straight)

  resumed = as_at_checkpoint(straight, tmp_path / "resumed", 5)  # As if stopped at step 5.
  train_and_evaluate(to_run_config(tiny_config), resumed)

  expected, got = train_losses(straight), train_losses(resumed)
  assert sorted(got) == list(range(1, 11))
  for step in range(1, 11):
    assert got[step] == pytest.approx(expected[step], rel=1e-6), step
  position = json.loads((resumed / "checkpoints" / "5" / "data" / "metadata").read_text())
  # The windows each reader group supplied: 8 groups by default, 4 for the 4-shard prose dataset.
  assert position["reader_groups"] == (4 if mixture else 8)
  assert position["windows"] * position["reader_groups"] == 5 * 8
  # The count is fixed when a run first starts: another one is refused, the same one accepted.
  assert json.loads((resumed / "config.json").read_text())["data.reader_groups"] == (
      4 if mixture else 8)
  tiny_config.data.reader_groups = 2
  with pytest.raises(UserError, match=rf"^config.data.reader_groups is 2, but the run in "
                                      rf"{resumed} started with {4 if mixture else 8}: its batches "
                                      rf"would change; leave the key unset to resume, or use a "
                                      rf"new --workdir$"):
    train_and_evaluate(to_run_config(tiny_config), resumed)
  tiny_config.data.reader_groups = 4 if mixture else 8
  assert train_and_evaluate(to_run_config(tiny_config), resumed) == {}  # Already finished.
  if mixture:
    final = read_metrics(resumed)
    assert {"eval/code/loss", "eval/prose/bits_per_byte", "eval/loss"} <= set(final[-1])
    tokens = [m for m in final if "data/tokens/code" in m][-1]
    assert tokens["data/tokens/code"] + tokens["data/tokens/prose"] == 10 * 8 * 64
    assert tokens["data/tokens/code"] > 2 * tokens["data/tokens/prose"]


@pytest.mark.slow
def test_keeps_the_newest_checkpoints(tiny_config, tmp_path):
  tiny_config.checkpoint.every_steps = 2
  tiny_config.checkpoint.keep = 2
  tiny_config.trainer.num_train_steps = 7
  train_and_evaluate(to_run_config(tiny_config), tmp_path)
  assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == [6, 7]


@pytest.mark.slow
def test_two_dimensional_mesh_trains(tiny_config, tmp_path):
  tiny_config.trainer.device_mesh = mesh(data=4, model=2)
  tiny_config.trainer.num_train_steps = 3
  train_and_evaluate(to_run_config(tiny_config), tmp_path)
  assert sorted(train_losses(tmp_path)) == [1, 2, 3]


@pytest.mark.parametrize("section, key, value, message", [
    ("trainer", "batch_size", 12, r"config.trainer.batch_size \(12\) / gradient_accumulation_steps \(1\) must be divisible by the activation axis size \(8\)"),
    ("model", "vocab_size", 200, r"config.model.vocab_size \(200\) is smaller than the vocabulary of the tokenizer \(257\)"),
    ("trainer", "device_mesh", mesh(data=3, model=-1), r"8 devices are not divisible by the fixed axes' product 3"),
    ("model", "attention_impl", "cudnn", r"config.model.compute.attention_impl 'cudnn' needs an NVIDIA GPU; this run's backend is cpu"),
    ("model", "remat", "offload", r"config.model.compute.remat 'offload' moves activations to host memory"),
])
def test_bad_settings_are_named(tiny_config, tmp_path, section, key, value, message):
  tiny_config[section][key] = value
  with pytest.raises(UserError, match=message):
    train_and_evaluate(to_run_config(tiny_config), tmp_path)


def test_unwritable_workdir_is_named(tiny_config, tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  with pytest.raises(UserError, match=f"cannot create workdir {blocker}/run"):
    train_and_evaluate(to_run_config(tiny_config), blocker / "run")
