"""Checkpoints with an orbax CheckpointManager: periodic saves, retention, resume."""
import pathlib
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp


class Checkpointer:
  """Saves the train state asynchronously and keeps the newest `keep` checkpoints."""

  def __init__(self, directory: pathlib.Path, keep: int):
    self._manager = ocp.CheckpointManager(
        directory.absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

  @property
  def latest_step(self) -> Optional[int]:
    return self._manager.latest_step()

  def restore_latest(self, abstract_state: Any) -> Any:
    """Restores the newest checkpoint onto the shardings carried by `abstract_state`."""
    return self._manager.restore(self.latest_step, args=ocp.args.StandardRestore(abstract_state))

  def save(self, step: int, state: Any) -> None:
    """Starts writing `state`; training continues while orbax finishes in the background."""
    self._manager.save(step, args=ocp.args.StandardSave(state), force=True)

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def abstract_like(shapes: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs that tell orbax where each restored array must live."""
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      shapes, shardings)
