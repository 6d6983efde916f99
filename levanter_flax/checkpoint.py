"""Checkpoints with an orbax CheckpointManager: the train state and the data position, together."""
import json
import os
import pathlib
import re
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from absl import logging

from levanter_flax import models
from levanter_flax.errors import UserError, ensure_writable_dir


class Checkpointer:
  """Saves asynchronously; keeps the newest `keep`, plus every `keep_period`-th step for good.

  Each checkpoint holds two items: `state` (params, optimizer state, step)
  and `data`, the JSON position of the input stream, so a resumed run reads
  on from exactly where the saved one stopped. A temporary checkpoint (a
  time-based one) is deleted once a newer checkpoint has been written.
  """

  def __init__(self, directory: pathlib.Path, keep: int, keep_period: int = 0):
    self.directory = ensure_writable_dir(directory.absolute(), "checkpoint directory")
    self._manager = ocp.CheckpointManager(
        directory.absolute(), item_names=("state", "data"),
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, keep_period=keep_period or None,
                                             create=True, cleanup_tmp_directories=True))
    self._temporary: list[int] = []  # Written as temporary, oldest first.
    self._writing: Optional[int] = None  # The step whose asynchronous save may still run.

  @property
  def latest_step(self) -> Optional[int]:
    return self._manager.latest_step()

  def restore_newest_usable(self, abstract_state: Any,
                            start_fresh_if_unusable: bool = False) -> Optional[tuple[Any, dict]]:
    """The newest checkpoint that restores, as (state, data position); None if there is none.

    Arrays land on the shardings in `abstract_state`. A checkpoint that fails
    to restore (damaged or missing files) is renamed `<step>.unreadable`, kept
    for inspection, with a warning, and the next older one is tried. If none
    restores, that is an error unless `start_fresh_if_unusable`.
    """
    unreadable = []
    for step in sorted(self._manager.all_steps(), reverse=True):
      try:
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
      except Exception as e:  # pylint: disable=broad-except  # orbax and tensorstore raise many kinds.
        logging.warning("Checkpoint %s cannot be restored: %s", self.directory / str(step),
                        _first_line(e))
        unreadable.append(step)
        continue
      self._set_aside(unreadable)
      if unreadable:
        logging.warning("Resuming from checkpoint %d instead of the newer, unreadable %s (kept as "
                        "<step>.unreadable in %s)", step, unreadable, self.directory)
      return restored.state, restored.data
    if unreadable and not start_fresh_if_unusable:
      raise UserError(f"none of the checkpoints {unreadable} in {self.directory} can be restored; "
                      f"set config.trainer.start_fresh_if_unusable=True to set them aside and "
                      f"start from step 0")
    self._set_aside(unreadable)
    return None

  def _set_aside(self, steps: list[int]) -> None:
    if not steps:
      return
    if jax.process_index() == 0:  # Every process found the same ones; one renames them.
      for step in steps:
        (self.directory / str(step)).rename(self.directory / f"{step}.unreadable")
    multihost_utils.sync_global_devices("levanter_flax: unreadable checkpoints set aside")
    self._manager.reload()

  def save(self, step: int, state: Any, data_position: dict, temporary: bool = False) -> None:
    """Starts writing; training continues while orbax finishes in the background."""
    self._finish_writing()  # The previous save, long done by now as a rule.
    self._drop_superseded_temporaries()
    self._writing = step
    try:
      self._manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_position)), force=True)
    except Exception as e:  # pylint: disable=broad-except  # Whatever the filesystem raised.
      raise self._save_failed(e) from None
    if temporary:
      self._temporary.append(step)

  def _finish_writing(self) -> None:
    """Waits for the save in flight; if it failed (a full disk, say), that is a UserError."""
    if self._writing is None:
      return
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except  # Whatever the filesystem raised.
      raise self._save_failed(e) from None
    self._writing = None

  def _save_failed(self, error: Exception) -> UserError:
    """Names the checkpoint that was not written and the ones that are still there.

    Orbax writes into `<step>.orbax-checkpoint-tmp` and renames only a complete
    checkpoint, so a failed save leaves the earlier ones untouched; the
    leftover temporary directory is removed when the next run starts.
    """
    step, self._writing = self._writing, None
    # Tensorstore reports the OS error as a code inside a long message naming internal files.
    os_error = re.search(r"os_error_code='?(\d+)", str(error))
    reason = os.strerror(int(os_error.group(1))) if os_error else _first_line(error)
    earlier = [s for s in self._manager.all_steps() if s != step]
    return UserError(f"writing checkpoint {self.directory / str(step)} failed: {reason}; the "
                     f"earlier checkpoints {earlier or '(none)'} are intact")

  def _drop_superseded_temporaries(self) -> None:
    """Deletes temporary checkpoints older than the newest written one."""
    newest = self._manager.latest_step()
    for step in [s for s in self._temporary if newest is not None and s < newest]:
      if step in self._manager.all_steps():
        self._manager.delete(step)
      self._temporary.remove(step)

  def close(self) -> None:
    self._finish_writing()
    self._drop_superseded_temporaries()
    self._manager.close()


def load_other_run(path: pathlib.Path, abstract_state: Any) -> tuple[Any, dict]:
  """(state, data position) from one checkpoint of another run: path is <workdir>/checkpoints/<step>."""
  path = path.expanduser().absolute()
  if not (path / "state").is_dir():
    raise UserError(f"config.trainer.load_checkpoint_path {path} is not a checkpoint "
                    f"(expected <workdir>/checkpoints/<step>, holding state/)")
  manager = ocp.CheckpointManager(path.parent, item_names=("state", "data"),
                                  options=ocp.CheckpointManagerOptions(read_only=True))
  try:
    restored = manager.restore(int(path.name), args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
  except Exception as e:  # pylint: disable=broad-except  # orbax and tensorstore raise many kinds.
    raise UserError(f"cannot load config.trainer.load_checkpoint_path {path} into this model: "
                    f"{_first_line(e)}") from None
  finally:
    manager.close()
  return restored.state, restored.data


def run_params(workdir: pathlib.Path) -> tuple[Any, Any, dict]:
  """(model config, params of the newest checkpoint, saved config.json) of a training workdir."""
  try:
    saved = json.loads((workdir / "config.json").read_text())
  except OSError:
    raise UserError(f"{workdir} has no config.json: not a levanter_flax workdir") from None
  fields = {k[len("model."):]: v for k, v in saved.items() if k.startswith("model.")}
  model_cfg = models.CONFIGS[fields.get("architecture", "gpt2")](**fields)
  steps = sorted(int(p.name) for p in (workdir / "checkpoints").glob("*") if p.name.isdigit())
  if not steps:
    raise UserError(f"{workdir}/checkpoints holds no checkpoint")
  state = ocp.StandardCheckpointer().restore(
      (workdir / "checkpoints" / str(steps[-1]) / "state").absolute())
  return model_cfg, state["params"], saved


def _first_line(error: Exception) -> str:
  text = str(error).strip()
  return text.splitlines()[0] if text else type(error).__name__


def abstract_like(shapes: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs that tell orbax where each restored array must live."""
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      shapes, shardings)
