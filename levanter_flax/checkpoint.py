"""Checkpoints with an orbax CheckpointManager: the train state and the data position, together."""
import pathlib
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp


class Checkpointer:
  """Saves asynchronously and keeps the newest `keep` checkpoints.

  Each checkpoint holds two items: `state` (params, optimizer state, step)
  and `data`, the JSON position of the input stream, so a resumed run reads
  on from exactly where the saved one stopped.
  """

  def __init__(self, directory: pathlib.Path, keep: int):
    self._manager = ocp.CheckpointManager(
        directory.absolute(), item_names=("state", "data"),
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

  @property
  def latest_step(self) -> Optional[int]:
    return self._manager.latest_step()

  def restore_latest(self, abstract_state: Any) -> tuple[Any, dict]:
    """The newest (state, data position); arrays land on the shardings in `abstract_state`."""
    restored = self._manager.restore(self.latest_step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
    return restored.state, restored.data

  def save(self, step: int, state: Any, data_position: dict) -> None:
    """Starts writing; training continues while orbax finishes in the background."""
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_position)), force=True)

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def abstract_like(shapes: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs that tell orbax where each restored array must live."""
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      shapes, shardings)
