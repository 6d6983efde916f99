"""Checkpoint damage, file by file: what is set aside, what stops a run, and the errors behind each
verdict, as orbax and tensorstore raise them."""
import contextlib
import gc
import json
import logging
import os
import pathlib
import shutil
import tempfile
from typing import Any

import flax
import jax
import numpy as np
import pytest
from etils import epath
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from levanter_flax.checkpoint import store
from levanter_flax.training import step
from levanter_flax.checkpoint.store import CheckpointConfig, Checkpointer
from levanter_flax.generate.trained import run_params
from levanter_flax.core.errors import UserError

# A failed orbax restore leaves its read coroutines unawaited; Python reports each one.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def state() -> dict:
  """Params and optimizer state; `w` large enough to get an array data file of its own."""
  w = np.random.default_rng(0).normal(size=(128, 128)).astype(np.float32)
  return {"params": {"w": w, "b": np.ones(12, np.float32)},
          "opt_state": {"mu": np.full((128, 128), 0.5, np.float32)}, "step": np.int32(2)}


def abstract_state() -> dict:
  mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
  sharded, replicated = (NamedSharding(mesh, PartitionSpec("data", "model")),
                         NamedSharding(mesh, PartitionSpec()))
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=sharded if x.ndim == 2 else replicated), state())


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> pathlib.Path:
  """Checkpoints 1 and 2, sharded over the 8 devices, as a run writes them."""
  directory = tmp_path_factory.mktemp("checkpoints")
  sharded = jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), state(), abstract_state())
  with contextlib.closing(Checkpointer(epath.Path(directory), CheckpointConfig(every_steps=1, keep=5))) as c:
    for step in (1, 2):
      c.save(step, sharded, {"windows": step})
  return directory


@pytest.fixture
def checkpoints(saved) -> pathlib.Path:
  """A copy of `saved` that every user may read, so that a test can take one file away."""
  directory = pathlib.Path(tempfile.mkdtemp(prefix="levanter_flax-checkpoints-"))
  shutil.copytree(saved, directory, dirs_exist_ok=True)
  directory.chmod(0o755)
  yield directory
  shutil.rmtree(directory)
  gc.collect()  # A failed restore's abandoned reads are reported now, under this module's filter.


def restore(directory: pathlib.Path) -> dict:
  """The data position of the checkpoint restored."""
  with contextlib.closing(Checkpointer(epath.Path(directory), CheckpointConfig(every_steps=1,
                                                                      keep=5))) as c:
    _, data = c.restore_newest_usable(abstract_state(), lambda data: data)
  return data


NOBODY = 65534


@contextlib.contextmanager
def unreadable(path: pathlib.Path):
  """`path` may not be read (mode 000) for a while, by root too: a root process acts as nobody
  meanwhile (seteuid changes every thread's, tensorstore's too)."""
  mode = path.stat().st_mode
  path.chmod(0)
  root = os.geteuid() == 0
  if root:
    os.seteuid(NOBODY)
  try:
    yield
  finally:
    if root:
      os.seteuid(0)
    path.chmod(mode)


def array_data_file(step: pathlib.Path) -> pathlib.Path:
  return max((step / "state" / "ocdbt.process_0" / "d").iterdir(), key=lambda p: p.stat().st_size)


def cut(path: pathlib.Path, size: int = 100) -> None:
  path.write_bytes(path.read_bytes()[:size])


def garble(path: pathlib.Path, offset: int, data: bytes) -> None:
  content = bytearray(path.read_bytes())
  content[offset:offset + len(data)] = data
  path.write_bytes(bytes(content))


def emptied(step: pathlib.Path) -> None:
  shutil.rmtree(step)
  step.mkdir()


def replaced_by_a_file(path: pathlib.Path) -> None:
  shutil.rmtree(path)
  path.write_text("not a directory")


# What a disk, a copy or a user may do to a checkpoint's files.
DAMAGE = {
    "an emptied step directory": emptied,
    "no state item": lambda step: shutil.rmtree(step / "state"),
    "no data item": lambda step: shutil.rmtree(step / "data"),
    "a file for the state item": lambda step: replaced_by_a_file(step / "state"),
    "no state/_METADATA": lambda step: (step / "state" / "_METADATA").unlink(),
    "a cut state/_METADATA": lambda step: cut(step / "state" / "_METADATA"),
    "a garbled state/_METADATA": lambda step: garble(step / "state" / "_METADATA", 300, b"\xff" * 4),
    "no data/metadata": lambda step: (step / "data" / "metadata").unlink(),
    "a cut data/metadata": lambda step: cut(step / "data" / "metadata", 5),
    "no manifest.ocdbt": lambda step: (step / "state" / "manifest.ocdbt").unlink(),
    "a cut manifest.ocdbt": lambda step: cut(step / "state" / "manifest.ocdbt", 50),
    "a garbled manifest.ocdbt header": lambda step: garble(step / "state" / "manifest.ocdbt", 40,
                                                           b"x" * 8),
    "no array data file": lambda step: array_data_file(step).unlink(),
    "a cut array data file": lambda step: cut(array_data_file(step)),
    "no b-tree node": lambda step: [p.unlink() for p in (step / "state" / "d").iterdir()],
    "a garbled state/_sharding": lambda step: garble(step / "state" / "_sharding", 0, b"{x"),
    "a garbled array_metadatas": lambda step: garble(
        step / "state" / "array_metadatas" / "process_0", 60, b"\xff" * 4),
}


@pytest.mark.slow
@pytest.mark.parametrize("damage", DAMAGE)
def test_damage_is_set_aside_and_the_checkpoint_before_used(checkpoints, damage):
  DAMAGE[damage](checkpoints / "2")
  assert restore(checkpoints) == {"windows": 1}
  assert sorted(p.name for p in checkpoints.iterdir()) == ["1", "2.unreadable"]


@pytest.mark.parametrize("missing", ["_CHECKPOINT_METADATA", "state/_sharding",
                                     "state/array_metadatas", "commit_success.txt"])
def test_files_a_restore_does_not_need_may_be_missing(checkpoints, missing):
  """Orbax's step metadata (read here for 'temporary' alone: without it, a checkpoint is kept),
  and what orbax writes beside the arrays that a target with its own shardings never reads."""
  path = checkpoints / "2" / missing
  if path.is_dir():
    shutil.rmtree(path)
  else:
    path.unlink()
  assert restore(checkpoints) == {"windows": 2}
  assert sorted(p.name for p in checkpoints.iterdir()) == ["1", "2"]


# What a storage that refuses to read may refuse.
UNREADABLE = {
    "the step directory": lambda step: step,
    "the state item": lambda step: step / "state",
    "the data item": lambda step: step / "data",
    "state/_METADATA": lambda step: step / "state" / "_METADATA",
    "data/metadata": lambda step: step / "data" / "metadata",
    "manifest.ocdbt": lambda step: step / "state" / "manifest.ocdbt",
    "the array data file": array_data_file,
    "state/_sharding": lambda step: step / "state" / "_sharding",
}


@pytest.mark.parametrize("what", UNREADABLE)
def test_a_storage_that_refuses_to_read_stops_the_run_and_sets_nothing_aside(checkpoints, what):
  step = checkpoints / "2"
  with unreadable(UNREADABLE[what](step)), pytest.raises(
      UserError, match=rf"^cannot read checkpoint {step}: Permission denied; it was left as it is"):
    restore(checkpoints)
  assert sorted(p.name for p in checkpoints.iterdir()) == ["1", "2"]


def decisive_cause(error: BaseException) -> BaseException:
  """The exception in `error`'s chain whose type the verdict rests on."""
  return next(c for c in store._causes(error) if store._verdict(c))


# Each damage or refusal, the exception that decides its verdict as orbax and tensorstore raise
# it (type; for tensorstore, the status code it words and the errno it adds), and the verdict.
PINNED = {
    # Tensorstore reads a data file that is gone as an empty compressed stream.
    "no array data file": (ValueError, "FAILED_PRECONDITION", None, True),
    "a cut array data file": (ValueError, "OUT_OF_RANGE", None, True),
    "no manifest.ocdbt": (ValueError, "NOT_FOUND", None, True),
    "a cut manifest.ocdbt": (ValueError, "DATA_LOSS", None, True),  # Its checksum.
    "a garbled manifest.ocdbt header": (ValueError, "INVALID_ARGUMENT", None, True),
    "a garbled state/_sharding": (ValueError, "FAILED_PRECONDITION", None, True),
    "a cut state/_METADATA": (json.JSONDecodeError, None, None, True),
    "a garbled state/_METADATA": (UnicodeDecodeError, None, None, True),
    "no state/_METADATA": (FileNotFoundError, None, None, True),
    "a file for the state item": (NotADirectoryError, None, None, True),
    "the array data file": (ValueError, "PERMISSION_DENIED", 13, False),
    "manifest.ocdbt": (ValueError, "PERMISSION_DENIED", 13, False),
    "state/_METADATA": (PermissionError, None, None, False),
    "the data item": (PermissionError, None, None, False),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", PINNED)
def test_the_errors_each_verdict_rests_on_are_as_orbax_and_tensorstore_raise_them(
    checkpoints, monkeypatch, case):
  """A tensorstore or orbax release that words or types one differently fails here."""
  errors = []

  def spied(error, path):
    errors.append(error)
    return classified(error, path)
  classified = store.classified
  monkeypatch.setattr(store, "classified", spied)
  step = checkpoints / "2"
  error_type, code, os_error, damaged = PINNED[case]
  if case in DAMAGE:
    DAMAGE[case](step)
    restore(checkpoints)
  else:
    with unreadable(UNREADABLE[case](step)), pytest.raises(UserError):
      restore(checkpoints)
  cause = decisive_cause(errors[0])
  assert type(cause) is error_type  # pylint: disable=unidiomatic-typecheck
  if error_type is ValueError:  # Tensorstore's: the status in absl's words, payloads appended.
    text = str(cause)
    if code == "INVALID_ARGUMENT":  # Its code left out; known by the spec tensorstore adds.
      assert not text.startswith(store._STATUS_CODES) and "[tensorstore_spec=" in text
    else:
      assert text.startswith(f"{code}: ")
    assert (f"[os_error_code='{os_error}']" in text) == (os_error is not None)
    assert store._tensorstore_status(cause) == (code, os_error)
  assert isinstance(classified(errors[0], step), store._Damaged) == damaged


def test_run_params_reads_params_alone_to_the_host_without_orbax_warnings(saved, tmp_path, caplog):
  shutil.copytree(saved / "2", tmp_path / "checkpoints" / "2")
  (tmp_path / "config.json").write_text(json.dumps({  # What run_params reads of it.
      "model.vocab_size": 50, "model.seq_len": 8, "model.num_layers": 1, "model.num_heads": 1,
      "model.hidden_dim": 4}))
  with caplog.at_level(logging.WARNING):
    _, params, _ = run_params(epath.Path(tmp_path))
  assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(params))
  assert jax.tree.map(np.array_equal, params, state()["params"]) == {"w": True, "b": True}
  assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_killed_saves_leftovers_are_gone_once_the_checkpointer_is_made(tmp_path):
  """Orbax removes them in a thread of its own that only a save waits for; a run refused right
  after start-up then exited under it, and that thread logged an error after the run's line."""
  leftover = tmp_path / "8.orbax-checkpoint-tmp-1234" / "state"
  leftover.mkdir(parents=True)
  for i in range(3000):
    (leftover / f"chunk{i}").write_bytes(b"x")
  checkpointer = Checkpointer(epath.Path(tmp_path), CheckpointConfig(every_steps=1, keep=1))
  assert not leftover.parent.exists()
  checkpointer.close()


@flax.struct.dataclass
class _StateBeforeLora:
  """step.TrainState as runs before LoRA's frozen base saved it."""
  step: Any
  params: Any
  opt_state: Any


def test_a_state_checkpointed_before_the_frozen_base_existed_restores(tmp_path):
  saved = jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), state(), abstract_state())
  with contextlib.closing(Checkpointer(epath.Path(tmp_path), CheckpointConfig(every_steps=1))) as c:
    c.save(3, _StateBeforeLora(**saved), {"windows": 3})
  with contextlib.closing(Checkpointer(epath.Path(tmp_path), CheckpointConfig(every_steps=1))) as c:
    restored, data = c.restore_newest_usable(step.TrainState(**abstract_state()).checkpointed,
                                             lambda data: data)
  restored = step.TrainState.from_checkpointed(restored)
  assert data == {"windows": 3} and int(restored.step) == 2 and restored.frozen is None
  np.testing.assert_array_equal(restored.params["w"], state()["params"]["w"])
