"""Checkpoints with an orbax CheckpointManager: the train state and the data position, together."""
import dataclasses
import datetime
import errno
import json
import os
import re
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies
from jax.experimental import multihost_utils
from absl import logging
from etils import epath

from levanter_flax.core import checks, paths
from levanter_flax.core.errors import UserError
from levanter_flax.core.schema import setting

# A LoRA run's frozen base, in its workdir: written once when the run starts, not in every
# checkpoint.
FROZEN_BASE = "lora_base"
# The reference model of a run whose objective needs one (DPO, GRPO with a KL; without LoRA: a
# copy of its initial params), in its workdir, the same way. Named when DPO was the only one.
REFERENCE = "dpo_reference"


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """When checkpoints are written, which are kept, and where a run starts from
  (config.checkpoint)."""
  every_steps: int = setting(500, "Save every this many steps (and at the last)")
  keep: int = setting(3, "Keep the newest this many checkpoints, temporary ones included")
  every_minutes: float = setting(
      0.0, "Also save every this many minutes (0: never), at the next log step; process 0's "
      "clock decides for every process. Such a checkpoint is temporary: deleted once a newer one "
      "is written, even after a restart")
  keep_every_steps: int = setting(0, "Keep every checkpoint whose step is a multiple of this for "
                                  "good (0: none)")
  load_path: str = setting(
      "", "Start a new run from another run's checkpoint (<workdir>/checkpoints/<step>); ignored "
      "once this run has checkpoints of its own")
  load_items: str = setting(
      "params", "What load_path gives: params only (step 0, fresh optimizer and data), or the "
      "whole state (step, optimizer state and data position too)")
  start_fresh_if_unusable: bool = setting(
      False, "A damaged newest checkpoint is set aside as <step>.unreadable and the one before "
      "it used; when all are damaged the run stops, unless this lets it start over")
  resume_without_config: bool = setting(
      False, "Resume checkpoints that lack the config.json they were written with, unchecked "
      "(else refused: nothing can check this config fits them)")

  def __post_init__(self):
    checks.positive(self, "checkpoint", ("every_steps", "keep"))
    checks.ranges(self, "checkpoint", {
        "keep_every_steps": checks.at_least(0, "0: none"),
        "every_minutes": checks.at_least(0, "0: never")})
    if self.load_items not in ("params", "state"):
      raise UserError(f"config.checkpoint.load_items must be 'params' or 'state'; "
                      f"got {self.load_items!r}")


class Checkpointer:
  """Saves asynchronously when orbax's save-decision policies say so; orbax deletes the rest.

  Each checkpoint holds two items: `state` (params, optimizer state, step)
  and `data`, the JSON position of the input stream, so a resumed run reads
  on from exactly where the saved one stopped. A checkpoint written because
  time passed is temporary: its step metadata says so, and it is deleted
  once a newer checkpoint is written, by this run or a later one.
  """

  def __init__(self, directory: epath.Path, config: CheckpointConfig,
               before_save: Callable[[], None] = lambda: None):
    """`before_save` is called on every process before each save; it may raise to stop the run
    (locks.JobLock.check_all: the workdir's lock was lost)."""
    self.directory = paths.make_dirs(directory, "checkpoint directory")
    self.before_save = before_save  # Also before the run's other writes (save_frozen).
    self._by_step = policies.FixedIntervalPolicy(config.every_steps)
    # Decided on process 0 and shared through jax's key-value store: each process's own
    # clock could disagree about a save, and a save is collective.
    self._by_time = (policies.ContinuousCheckpointingPolicy(
        minimum_interval_secs=60 * config.every_minutes) if config.every_minutes else None)
    self._last_save = _SaveTime(0, _now())  # Time-based saves count from this run's start too.
    self._temporary: dict[int, bool] = {}
    self._manager = ocp.CheckpointManager(
        directory, item_handlers=_item_handlers(),
        options=ocp.CheckpointManagerOptions(
            preservation_policy=_KeptCheckpoints(config.keep, config.keep_every_steps,
                                                 self._is_temporary),
            create=True, cleanup_tmp_directories=True))
    # Orbax removes the half-written checkpoints of a killed run in a thread that only its
    # next save waits for (orbax 0.12): a run refused right after this, exiting, cut that
    # thread off, which then logged an error after the run's one-line error.
    self._manager._maybe_await_cleanup_tmp_directory()  # pylint: disable=protected-access
    self._writing: Optional[int] = None  # The step whose asynchronous save may still run.

  @property
  def latest_step(self) -> Optional[int]:
    return self._manager.latest_step()

  def restore_newest_usable(self, abstract_state: Any, parse_data: Callable[[dict], Any],
                            start_fresh_if_unusable: bool = False,
                            config_changes: Sequence[str] = ()) -> Optional[tuple[Any, Any]]:
    """The newest checkpoint that restores, as (state, parse_data(its data item)); None if none.

    Arrays land on the shardings in `abstract_state`. A checkpoint that is
    damaged (a missing, truncated or garbled file or item) is renamed
    `<step>.unreadable`, kept for inspection, with a warning, and the next
    older one is tried; if none is left, that is an error unless
    `start_fresh_if_unusable`. A checkpoint that holds another state than this
    run builds, or that fails to read for any other reason (permissions, a
    storage outage), is left alone and stops the run: it is not damage.
    `config_changes` ("key old -> new") are named when the state differs.
    Every process reaches the same verdict on each checkpoint.
    """
    damaged = []
    for step in sorted(self._manager.all_steps(), reverse=True):
      restored, failure = None, None
      try:
        restored = self._restore(step, abstract_state, parse_data, config_changes)
      except _Damaged as e:
        logging.warning("Checkpoint %s is damaged: %s", self.directory / str(step), e)
      except UserError as e:
        failure = e
      verdicts = _gathered(_FAILED if failure else _DAMAGED if restored is None else _RESTORED)
      if _FAILED in verdicts:
        raise failure or UserError(f"process {verdicts.index(_FAILED)} cannot read checkpoint "
                                   f"{self.directory / str(step)}; see its log")
      if _DAMAGED in verdicts:
        damaged.append(step)
        continue
      self._set_aside(damaged)
      if damaged:
        logging.warning("Resuming from checkpoint %d instead of the newer, damaged %s (kept as "
                        "<step>.unreadable in %s)", step, damaged, self.directory)
      return restored.state, restored.data
    if damaged and not start_fresh_if_unusable:
      raise UserError(f"the checkpoints {damaged} in {self.directory} are all damaged; set "
                      f"config.checkpoint.start_fresh_if_unusable=True to set them aside and start "
                      f"from step 0")
    self._set_aside(damaged)
    return None

  def _restore(self, step: int, abstract_state: Any, parse_data: Callable[[dict], Any],
               config_changes: Sequence[str]) -> Any:
    """One checkpoint; raises _Damaged for damage and a UserError for anything else."""
    path = self.directory / str(step)
    # Through the item handlers, not the manager: its restore ends in a barrier that a process
    # whose read failed never reaches, which would leave the others waiting there for ever; and
    # its metadata takes a missing item and one it failed to read for the same: absent.
    # Each process reads its own shards and returns here; the verdicts are then shared.
    handlers = _item_handlers()
    try:
      for name in _ITEM_FILES:
        (path / name).stat()
      saved = handlers["state"].metadata(path / "state")
    except Exception as e:  # pylint: disable=broad-except  # orbax and tensorstore raise many kinds.
      raise classified(e, path) from None
    mismatch = _layout_differences(saved, abstract_state)
    if mismatch:
      changed = f"; the config changed: {', '.join(config_changes)}" if config_changes else ""
      raise UserError(f"checkpoint {path} holds another state than this run builds "
                      f"({'; '.join(mismatch)}){changed}; restore the settings it was written "
                      f"with, or use a new --workdir")
    try:
      state = handlers["state"].restore(path / "state",
                                        args=ocp.args.StandardRestore(abstract_state))
      data = handlers["data"].restore(path / "data", args=ocp.args.JsonRestore())
    except Exception as e:  # pylint: disable=broad-except  # orbax and tensorstore raise many kinds.
      raise classified(e, path) from None
    try:
      return _Restored(state, parse_data(data))
    except ValueError as e:
      raise _Damaged(f"its data item is malformed: {e}") from None

  def _set_aside(self, steps: list[int]) -> None:
    if not steps:
      return
    if jax.process_index() == 0:  # Every process reached the same verdict; one renames.
      for step in steps:
        paths.move_tree(self.directory / str(step),
                        _free_name(self.directory, f"{step}.unreadable"))
    multihost_utils.sync_global_devices("levanter_flax: damaged checkpoints set aside")
    self._manager.reload()

  def due(self, step: int, forced: bool = False, ask_clock: bool = True) -> Optional[str]:
    """Why `step` is saved: "step" (forced, or a multiple of every_steps), "time", or None.

    Every process gets the same answer. Asking the clock costs a round trip
    to process 0 on every process; `ask_clock=False` skips it for this step.
    """
    context = policies.DecisionContext(
        is_saving_in_progress=self._manager.is_saving_in_progress(), reached_preemption=False,
        multiprocessing_options=ocp.options.MultiprocessingOptions())
    now = _SaveTime(step, _now())
    if forced or self._by_step.should_save(now, [], context=context):
      return "step"
    if ask_clock and self._by_time and self._by_time.should_save(now, [self._last_save],
                                                                 context=context):
      return "time"
    return None

  def save(self, step: int, state: Any, data_position: dict, due: str = "step") -> None:
    """Starts writing; training continues while orbax finishes in the background."""
    self._finish_writing()  # The previous save, long done by now as a rule.
    self.before_save()
    self._writing, self._last_save = step, _SaveTime(step, _now())
    self._temporary[step] = due == "time"
    try:
      self._manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_position)),
          custom_metadata={"temporary": due == "time"}, force=True)
    except Exception as e:  # pylint: disable=broad-except  # Whatever the filesystem raised.
      raise self._save_failed(e) from None

  def _is_temporary(self, step: int) -> bool:
    """From the step's metadata, so a temporary written before a restart is known after it."""
    if step not in self._temporary:
      try:
        custom = self._manager.metadata(step).custom_metadata or {}
      except Exception:  # pylint: disable=broad-except  # Unreadable metadata: keep it.
        custom = {}
      self._temporary[step] = bool(custom.get("temporary", False))
    return self._temporary[step]

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
    reason = os.strerror(int(os_error.group(1))) if os_error else first_line(error)
    earlier = [s for s in self._manager.all_steps() if s != step]
    return UserError(f"writing checkpoint {self.directory / str(step)} failed: {reason}; the "
                     f"earlier checkpoints {earlier or '(none)'} are intact")

  def close(self) -> None:
    self._finish_writing()
    self._manager.close()


@dataclasses.dataclass
class _SaveTime:
  """orbax's PolicyCheckpointInfo for a step being decided, or the last one saved."""
  step: int
  time: datetime.datetime
  metrics: Optional[dict] = None


def _now() -> datetime.datetime:
  return datetime.datetime.now(tz=datetime.timezone.utc)


@dataclasses.dataclass
class _KeptCheckpoints(policies.PreservationPolicy):
  """The newest `keep` checkpoints, less temporary ones that a newer one superseded; and
  every `keep_period`-th step for good."""
  keep: int
  keep_period: int
  is_temporary: Callable[[int], bool]

  def should_preserve(self, checkpoints: Sequence[Any], *,
                      context: policies.PreservationContext) -> list[bool]:
    newest = policies.LatestN(self.keep).should_preserve(checkpoints, context=context)
    kept = [latest and (i == len(checkpoints) - 1 or not self.is_temporary(c.step))
            for i, (c, latest) in enumerate(zip(checkpoints, newest))]
    if self.keep_period:
      periodic = policies.EveryNSteps(self.keep_period).should_preserve(checkpoints,
                                                                        context=context)
      kept = [k or p for k, p in zip(kept, periodic)]
    return kept


def _item_handlers() -> dict[str, ocp.CheckpointHandler]:
  """Named up front, so a checkpoint's metadata can be read before anything is restored."""
  return {"state": ocp.StandardCheckpointHandler(), "data": ocp.JsonCheckpointHandler()}


class _Restored(NamedTuple):
  state: Any
  data: Any


class _Damaged(Exception):
  """A checkpoint's files are missing, truncated or garbled: it can never be read."""


# The file each item's handler looks for first, with `exists()`, which answers False for a file
# the storage refused to show as for one that is gone. `stat` tells the two apart, so it is
# asked first: FileNotFoundError, or the storage's own error.
_ITEM_FILES = ("state/_METADATA", "data/metadata")


def classified(error: Exception, path: epath.Path) -> Exception:
  """_Damaged if `error` means the checkpoint's files are bad, else a UserError naming it.

  The first exception in the chain whose type tells decides (see _verdict).
  Anything else is not known to be damage: the run stops and the checkpoint is
  left alone.
  """
  for cause in _causes(error):
    verdict = _verdict(cause)
    if verdict:
      damaged, reason = verdict
      return _Damaged(reason) if damaged else _unreadable(path, reason)
  return _unreadable(path, first_line(error))


def _causes(error: BaseException) -> Iterator[BaseException]:
  while error is not None:
    yield error
    error = error.__cause__ or error.__context__


# An OS error is the storage's (permissions, I/O, timeouts), unless it says that a file or
# directory is not where the checkpoint has it: as an exception type, or as tensorstore's errno.
_MISSING = (FileNotFoundError, NotADirectoryError, IsADirectoryError)
_MISSING_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EISDIR})


def _verdict(error: BaseException) -> Optional[tuple[bool, str]]:
  """(damaged, reason) if the type of `error` tells, else None.

  Damage: text that does not decode or parse (orbax reads its own metadata and
  the data item), a missing file, and tensorstore's damage codes. The storage
  failing this time: any other OS error or status code.
  """
  if isinstance(error, (json.JSONDecodeError, UnicodeDecodeError, EOFError)):
    return True, first_line(error)
  if isinstance(error, OSError):
    if isinstance(error, _MISSING):
      return True, first_line(error)
    return False, error.strerror or first_line(error)
  status = _tensorstore_status(error)
  if status is None:
    return None
  if status.os_error is not None:
    if status.os_error in _MISSING_ERRNOS:
      return True, first_line(error)
    return False, os.strerror(status.os_error)
  return status.code in _DAMAGE_CODES, first_line(error)


# absl's status codes (absl/status/status.h), which tensorstore reports.
_STATUS_CODES = ("CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
                 "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
                 "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
                 "UNAUTHENTICATED")
# The codes that say the bytes read are gone (NOT_FOUND), too short (OUT_OF_RANGE) or do not
# decode (DATA_LOSS: a checksum; FAILED_PRECONDITION, INVALID_ARGUMENT: a format). The others
# (PERMISSION_DENIED, UNAVAILABLE, DEADLINE_EXCEEDED, ...) say the storage failed this time.
_DAMAGE_CODES = frozenset({"DATA_LOSS", "OUT_OF_RANGE", "NOT_FOUND", "FAILED_PRECONDITION",
                           "INVALID_ARGUMENT"})
_STATUS = re.compile(rf"({'|'.join(_STATUS_CODES)}): ")
_OS_ERROR = re.compile(r"\[os_error_code='(\d+)'\]")
_TENSORSTORE_SPEC = "[tensorstore_spec="


class _Status(NamedTuple):
  code: str
  os_error: Optional[int]  # The errno of the OS call that failed, if one did.


def _tensorstore_status(error: BaseException) -> Optional[_Status]:
  """The status of a tensorstore error; None for any other exception.

  Tensorstore raises a plain ValueError and has no attribute for the status: the
  code is the message's first word, in absl's own format ("DATA_LOSS: ..."), but
  for INVALID_ARGUMENT, which it leaves out; a failed OS call adds its errno as
  the payload `[os_error_code='13']`. A ValueError without a code is taken for
  tensorstore's INVALID_ARGUMENT only with the `[tensorstore_spec=...]` payload
  that tensorstore adds when a driver fails to open: the last resort, as jax and
  orbax raise plain ValueErrors too. tests/test_checkpoint.py pins all this.
  """
  if type(error) is not ValueError:  # pylint: disable=unidiomatic-typecheck  # Not subclasses.
    return None
  text = str(error)
  code = _STATUS.match(text)
  if not code and _TENSORSTORE_SPEC not in text:
    return None
  os_error = _OS_ERROR.search(text)
  return _Status(code.group(1) if code else "INVALID_ARGUMENT",
                 int(os_error.group(1)) if os_error else None)


def _unreadable(path: epath.Path, reason: str) -> UserError:
  return UserError(f"cannot read checkpoint {path}: {reason}; it was left as it is. "
                   f"Run again once the storage is readable; if the checkpoint is damaged, move "
                   f"it away (mv {path} {path}.unreadable)")


_RESTORED, _DAMAGED, _FAILED = 0, 1, 2  # One process's verdict on one checkpoint.


def _gathered(verdict: int) -> list[int]:
  """Every process's verdict, in process order: all decide alike from the same list."""
  if jax.process_count() == 1:
    return [verdict]
  return multihost_utils.process_allgather(np.array(verdict)).tolist()


def _leaf_layouts(tree: Any) -> dict[str, str]:
  """'opt_state/1/0/mu/wte/embedding' -> 'float32 (384, 64)', alike for dicts, lists and
  dataclasses."""
  def name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
  return {name(path): f"{np.dtype(leaf.dtype).name} {tuple(leaf.shape)}"
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _layout_differences(saved: Any, wanted: Any, limit: int = 3) -> list[str]:
  """The first few leaves that the checkpoint lacks, has extra, or holds in another shape or
  dtype (orbax would cast a dtype silently)."""
  saved, wanted = _leaf_layouts(saved), _leaf_layouts(wanted)
  differences = [f"{k}: missing in the checkpoint" for k in sorted(wanted.keys() - saved.keys())]
  differences += [f"{k}: not in this run's state" for k in sorted(saved.keys() - wanted.keys())]
  differences += [f"{k}: {saved[k]} in the checkpoint, {wanted[k]} here"
                  for k in sorted(wanted.keys() & saved.keys()) if saved[k] != wanted[k]]
  more = f"and {len(differences) - limit} more" if len(differences) > limit else ""
  return differences[:limit] + ([more] if more else [])


def _free_name(directory: epath.Path, name: str) -> epath.Path:
  """`name`, or `name.2`, `name.3`, ... whichever does not exist yet."""
  candidate, number = directory / name, 1
  while candidate.exists():
    number += 1
    candidate = directory / f"{name}.{number}"
  return candidate


def save_frozen(directory: epath.Path, frozen: Any,
                what: str = "the LoRA run's frozen base") -> None:
  """A LoRA run's frozen base (or a run's reference model: `what`), written whole (orbax renames
  a finished temporary directory) when the run starts from step 0, replacing any earlier
  start's."""
  try:
    with ocp.StandardCheckpointer() as checkpointer:
      checkpointer.save(directory, frozen, force=True)
      checkpointer.wait_until_finished()
  except Exception as e:  # pylint: disable=broad-except  # Whatever the filesystem raised.
    raise UserError(f"cannot write {directory}, {what}: {first_line(e)}") from None


def restore_frozen(directory: epath.Path, abstract: Any,
                   what: str = "the frozen base model that this LoRA run's checkpoints adapt"
                   ) -> Any:
  """save_frozen's tree, on the shardings in `abstract`."""
  try:
    (directory / "_METADATA").stat()
    with ocp.StandardCheckpointer() as checkpointer:
      return checkpointer.restore(directory, abstract)
  except Exception as e:  # pylint: disable=broad-except  # orbax and tensorstore raise many kinds.
    raise UserError(f"cannot read {directory}, {what} (written when the run started): "
                    f"{first_line(e)}") from None


def load_other_run(path: epath.Path, abstract_state: Any) -> tuple[Any, dict]:
  """(state, data position) from one checkpoint of another run: path is <workdir>/checkpoints/<step>."""
  if not (path / "state").is_dir():
    raise UserError(f"config.checkpoint.load_path {path} is not a checkpoint "
                    f"(expected <workdir>/checkpoints/<step>, holding state/)")
  manager = ocp.CheckpointManager(path.parent, item_names=("state", "data"),
                                  options=ocp.CheckpointManagerOptions(read_only=True))
  try:
    restored = manager.restore(int(path.name), args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
  except Exception as e:  # pylint: disable=broad-except  # orbax and tensorstore raise many kinds.
    raise UserError(f"cannot load config.checkpoint.load_path {path} into this model: "
                    f"{first_line(e)}") from None
  finally:
    manager.close()
  return restored.state, restored.data


def restore_to_host(path: epath.Path, item: Optional[str] = None) -> Any:
  """A saved tree (`item` of it alone: a state's params), as host numpy arrays: sampling and
  export run on one machine whatever mesh the run trained on (orbax would restore onto the
  saved one), and neither needs the optimizer state or a device big enough for the whole
  model.

  Through the handler: a Checkpointer would also look for step metadata in the item's
  directory, which has none, and warn that it does not exist."""
  (path / "_METADATA").stat()  # As in Checkpointer._restore: missing, or the storage's error.
  handler = ocp.PyTreeCheckpointHandler()
  tree = handler.metadata(path).tree
  tree = {item: tree[item]} if item else tree
  on_host = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
  restored = handler.restore(path, args=ocp.args.PyTreeRestore(
      item=tree, restore_args=on_host, partial_restore=True))
  return restored[item] if item else restored


# What absl appends to a status's message, one per payload: ` [name='value']`.
_PAYLOADS = re.compile(r" \[[\w\[\]]+='.*", re.DOTALL)


def first_line(error: BaseException) -> str:
  """The first line of the message, less tensorstore's payloads (its spec runs to kilobytes)."""
  text = _PAYLOADS.sub("", str(error)).strip()
  return text.splitlines()[0] if text else type(error).__name__


def abstract_like(shapes: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs that tell orbax where each restored array must live."""
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      shapes, shardings)
