"""A run's start: what it chooses, what it checks of a resume, and the state it starts from.

A run chooses some settings when it first starts (schema.CHOSEN): the batch for
trainer.batch_size "auto" (batch_search) and the reader groups for data.reader_groups 0
(position.default_reader_groups). config.json keeps the choice, and a resume keeps it from
there by config.keep_chosen, the rule the launcher applies too (launch/local.py), so a resumed
run reads the batches it would have read uninterrupted, whatever it would choose now.

Everything here is decided before anything is restored: `resolve` reads config.json, chooses,
checks, and returns the run as it trains; `initial_state` then restores or creates the state.
"""
import dataclasses
import functools
import json
from typing import Callable, Optional

import jax
import numpy as np
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from levanter_flax.train import batch_search, step
from levanter_flax import config
from levanter_flax.monitoring import history
from levanter_flax.parallel import distributed, partitioning
from levanter_flax.hf import snapshot
from levanter_flax.core import paths
from levanter_flax.checkpoint.store import (FROZEN_BASE, REFERENCE, Checkpointer, abstract_like,
                                      load_other_run, restore_frozen, save_frozen)
from levanter_flax.data import eval_set, loader
from levanter_flax.data.manifest import PreparedDataset
from levanter_flax.data.position import DataPosition, ReaderGroups, default_reader_groups
from levanter_flax.core.errors import UserError
from levanter_flax.config.settings import RunConfig, TrainerConfig


@dataclasses.dataclass(frozen=True)
class Start:
  """The run as it trains, resolved once, and what its loop reads besides the state."""
  run: RunConfig  # With what its start chose: a batch size, never "auto"; reader groups, never 0.
  sources: list[PreparedDataset]
  eos_id: Optional[int]  # The token that ends a document, for data.document_masking; else None.
  reader_groups: ReaderGroups  # This process's.
  config_changes: list[str]  # "key old -> new" against config.json, named if a restore fails.
  preference: bool = False  # The datasets are preference data: the run trains by DPO.


def resolve(run: RunConfig, workdir: epath.Path, partitioner: partitioning.Partitioner,
            checkpointer: Checkpointer) -> Start:
  """`run` as it trains in `workdir`: what its start chose, kept from config.json on a resume;
  its datasets. A resume that config.json refuses stops here, before anything is restored."""
  saved = _saved_config(workdir, checkpointer, run.checkpoint.resume_without_config)
  kept = config.keep_chosen(config.flat_dict(run), saved)
  sources = loader.load_datasets(run.data)
  _check_vocab(sources[0], run.model.vocab_size)
  preference = _preference(run, sources)
  # The step the search compiles is the one the run trains: DPO's reference, the loss weights.
  search = functools.partial(batch_search.resolve, run, partitioner,
                             loss_weights=loader.has_loss_weights(sources), preference=preference)
  trainer = _batch(run, kept, saved, search, workdir)
  _check_batch_size(trainer, partitioner)
  for source in sources:  # A split too small to evaluate: said now, not after the first steps.
    if source.has_validation:
      eval_set.num_windows(source, run.model.seq_len, trainer.eval_tokens)
  count = _reader_group_count(run, kept["data.reader_groups"], saved, trainer.batch_size, sources,
                              workdir)
  run = dataclasses.replace(run, trainer=trainer,
                            data=dataclasses.replace(run.data, reader_groups=count))
  groups = ReaderGroups.of_process(count, jax.process_index(), jax.process_count())
  # This process count and batch size must fit them: said before anything is restored.
  groups.rows_per_group(trainer.batch_size // jax.process_count(), "config.trainer.batch_size")
  config_changes = _check_resumed_config(run, saved, workdir)
  eos_id = sources[0].manifest["tokenizer"]["eos_id"] if run.data.document_masking else None
  return Start(run, sources, eos_id, groups, config_changes, preference)


def _preference(run: RunConfig, sources: list[PreparedDataset]) -> bool:
  """Whether the run trains by DPO: its datasets are preference data, all or none, each pair
  one row of config.model.seq_len, read with document masking."""
  pairs = [s for s in sources if s.preference_seq_len]
  if not pairs:
    return False
  if len(pairs) < len(sources):
    others = [s.name for s in sources if not s.preference_seq_len]
    names = ", ".join(s.name for s in pairs)
    raise UserError(f"config.data.mixture mixes preference data ({names}) with other data "
                    f"({', '.join(others)}): a DPO run trains on preference pairs alone")
  for source in pairs:
    if source.preference_seq_len != run.model.seq_len:
      raise UserError(f"dataset {source.directory} holds preference pairs in rows of "
                      f"{source.preference_seq_len} tokens (prepare --seq_len), but "
                      f"config.model.seq_len is {run.model.seq_len}: they must be equal")
  if not run.data.document_masking:
    raise UserError("config.data.document_masking must be True for preference data (DPO): the "
                    "rejected reply must not attend to the chosen one in its row")
  return True


def _saved_config(workdir: epath.Path, checkpointer: Checkpointer,
                  resume_without_config: bool) -> Optional[dict]:
  """The config.json the workdir's checkpoints were written with; None if it has none.

  Checkpoints without one are refused, unless `resume_without_config`: nothing
  could check that this config fits them.
  """
  if checkpointer.latest_step is None:
    return None
  path = workdir / "config.json"
  try:
    saved = config.read_saved(workdir)
  except (OSError, ValueError) as e:
    raise UserError(f"cannot read {path}, the config the checkpoints were written with: {e}; "
                    f"restore it, or use a new --workdir") from None
  if saved is None and not resume_without_config:
    raise UserError(f"{checkpointer.directory} holds checkpoints (the newest at step "
                    f"{checkpointer.latest_step}) but {path}, the config they were written with, "
                    f"is missing: nothing can check that this config fits them; restore it, or "
                    f"set config.checkpoint.resume_without_config=True to resume them unchecked")
  if saved is None:
    logging.warning("Resuming the checkpoints in %s without the config they were written with "
                    "(config.checkpoint.resume_without_config)", checkpointer.directory)
  return saved


def _batch(run: RunConfig, kept: dict, saved: Optional[dict],
           search: Callable[[], TrainerConfig], workdir: epath.Path) -> TrainerConfig:
  """The trainer with its batch: as set; for "auto", searched (`search`) when the run first
  starts, else as config.json keeps it (`kept`: config.keep_chosen's), never searched again."""
  trainer = run.trainer
  if trainer.batch_size != "auto":
    return trainer
  if kept["trainer.batch_size"] == "auto":  # The run's first start.
    trainer = search()
  else:
    trainer = dataclasses.replace(
        trainer, batch_size=kept["trainer.batch_size"],
        gradient_accumulation_steps=kept["trainer.gradient_accumulation_steps"])
    _warn_if_search_changed(saved, kept, trainer, workdir)
  logging.info("batch_size 'auto': %d sequences per step in %d microbatches",
               trainer.batch_size, trainer.gradient_accumulation_steps)
  return trainer


def _warn_if_search_changed(saved: dict, kept: dict, trainer: TrainerConfig,
                            workdir: epath.Path) -> None:
  """One warning when config.batch_search changed since the kept batch was chosen."""
  changed = config.changes(saved, kept, [k for k in kept if k.startswith("batch_search.")])
  if changed:
    logging.warning("Keeping the batch the run in %s chose when it started, trainer.batch_size "
                    "%d and gradient_accumulation_steps %d: config.batch_search changed (%s), "
                    "but a resume does not search again; use a new --workdir for a new search",
                    workdir, trainer.batch_size, trainer.gradient_accumulation_steps,
                    ", ".join(changed))


def _check_batch_size(trainer: TrainerConfig, partitioner: partitioning.Partitioner) -> None:
  partitioner.check_batch_size(trainer.batch_size, trainer.gradient_accumulation_steps)
  if (trainer.batch_size // trainer.gradient_accumulation_steps) % jax.process_count():
    raise UserError(f"config.trainer.batch_size ({trainer.batch_size}) / "
                    f"gradient_accumulation_steps ({trainer.gradient_accumulation_steps}) "
                    f"must be divisible by the process count ({jax.process_count()})")


def _check_vocab(source: PreparedDataset, vocab_size: int) -> None:
  needed = source.manifest["tokenizer"]["vocab_size"]
  if vocab_size < needed:
    raise UserError(f"config.model.vocab_size ({vocab_size}) is smaller than the vocabulary of "
                    f"the tokenizer ({needed}) that {source.directory} was prepared with")


def _reader_group_count(run: RunConfig, kept: int, saved: Optional[dict], batch_size: int,
                        sources: list[PreparedDataset], workdir: epath.Path) -> int:
  """data.reader_groups as the run first started with it: the batches depend on it.

  A new run takes config.data.reader_groups, or the default for its batch
  size and datasets; config.json then keeps it (`kept`: config.keep_chosen's)
  for every resume.
  """
  asked, started = run.data.reader_groups, (saved or {}).get("data.reader_groups", 0)
  if asked and started and asked != started:
    raise UserError(f"config.data.reader_groups is {asked}, but the run in {workdir} started "
                    f"with {started}: its batches would change; leave the key unset to resume, "
                    f"or use a new --workdir")
  if saved is not None and not kept:  # An older version: one per process.
    logging.warning("The run in %s saved no reader-group count (an older version read one per "
                    "process); resuming with %d, the same stream only if it ran on %d processes",
                    workdir, jax.process_count(), jax.process_count())
    return jax.process_count()
  return kept or default_reader_groups(batch_size, jax.process_count(), sources,
                                       run.model.seq_len)


def _check_resumed_config(run: RunConfig, saved: Optional[dict], workdir: epath.Path) -> list[str]:
  """Refuses to resume into another model or optimizer state; returns the other changes.

  Checked before anything is restored, so a changed optimizer is never taken
  for a damaged checkpoint.
  """
  if saved is None:
    return []
  now = config.flat_dict(run)
  refused = config.state_changes(saved, now)
  if refused:
    raise UserError(f"cannot resume the checkpoints in {workdir} with a different model or "
                    f"optimizer: {', '.join(refused)}; use a new --workdir")
  for old, (new, _) in config.REPLACED_KEYS.items():
    if old in saved:
      logging.warning("The run in %s started with %s, which %s replaced: its evals before this "
                      "resume scored another set", workdir, old, new)
  # Another coordinator address or process id is no news.
  changed = [c for c in config.changes(saved, now) if not c.startswith("trainer.distributed.")]
  for change in changed:
    logging.warning("Resuming with %s", change)
  return changed


def save_config(run: RunConfig, workdir: epath.Path) -> None:
  """<workdir>/config.json: what the checkpoints were written with, for the next resume."""
  if jax.process_index() > 0:  # The workdir is shared; one writer.
    return
  path = workdir / "config.json"
  try:
    paths.write_atomically(path, json.dumps(config.flat_dict(run), indent=2))
  except OSError as e:
    raise UserError(f"cannot write {path}: {e.strerror or e}") from None


@dataclasses.dataclass(frozen=True)
class Progress:
  """The checkpoint's `data` item: where the input stream is, the skipped-step counts
  (trainer.nan_policy='skip'), which a restart must not reset, and whether the run trains by
  DPO (its data decides, so a resume on data of the other kind must not switch silently)."""
  position: DataPosition
  skipped_steps: int = 0
  consecutive_skipped_steps: int = 0
  dpo: bool = False
  # spike_policy=rollback: the spikes within the last spike_window steps, (step, windows).
  recent_spikes: tuple[tuple[int, int], ...] = ()

  def to_json(self) -> dict:
    return self.position.to_json() | {"skipped_steps": self.skipped_steps,
                                      "consecutive_skipped_steps": self.consecutive_skipped_steps,
                                      "dpo": self.dpo,
                                      "recent_spikes": [list(s) for s in self.recent_spikes]}

  @classmethod
  def from_json(cls, value: dict) -> "Progress":
    """Raises ValueError for anything but what to_json writes (the counts: 0 if absent; dpo:
    False, as every run before DPO)."""
    position = DataPosition.from_json(value)
    counts = [value.get(key, 0) for key in ("skipped_steps", "consecutive_skipped_steps")]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts):
      raise ValueError(f"not a count of skipped steps: {counts}")
    if not isinstance(value.get("dpo", False), bool):
      raise ValueError(f"dpo is not a boolean: {value['dpo']!r}")
    spikes = value.get("recent_spikes", [])
    if not (isinstance(spikes, list) and all(
        isinstance(s, list) and len(s) == 2 and all(type(n) is int for n in s) for s in spikes)):
      raise ValueError(f"not a list of recent spikes: {spikes!r}")
    return cls(position, *counts, dpo=value.get("dpo", False),
               recent_spikes=tuple(tuple(s) for s in spikes))


def initial_state(start: Start, workdir: epath.Path, steps: step.ShardedSteps,
                  checkpointer: Checkpointer) -> tuple[step.TrainState, Progress]:
  """This run's newest usable checkpoint; else a Hugging Face checkpoint's params
  (init_from_hf) or another run's (checkpoint.load_path); else init."""
  run, sources = start.run, start.sources
  state, progress = _restored_or_initial_state(run, workdir, steps, checkpointer, sources,
                                               start.config_changes)
  position, reader_groups = progress.position, run.data.reader_groups
  if position.reader_groups not in (None, reader_groups):
    raise UserError(f"the data position of the checkpoint to resume from was read by "
                    f"{position.reader_groups} reader groups, but this run has {reader_groups} "
                    f"(config.data.reader_groups): set it to {position.reader_groups}")
  position = distributed.agreed(
      lambda: position.in_datasets_of(sources, run.data.restart_changed_datasets),
      "to resume on its datasets")
  return state, dataclasses.replace(progress, position=position)


def _restored_or_initial_state(run: RunConfig, workdir: epath.Path, steps: step.ShardedSteps,
                               checkpointer: Checkpointer, sources: list[PreparedDataset],
                               config_changes: list[str]) -> tuple[step.TrainState, Progress]:
  abstract = abstract_like(steps.abstract_state, steps.state_shardings)
  restored = checkpointer.restore_newest_usable(
      abstract.checkpointed, Progress.from_json, run.checkpoint.start_fresh_if_unusable,
      config_changes)
  if restored:
    saved, progress = restored
    logging.info("Resuming from checkpoint at step %d; %s", int(saved["step"]), progress)
    _check_objective(workdir, progress, steps.preference)
    frozen = None
    if abstract.frozen is not None:  # LoRA: the base the run saved when it started.
      frozen = restore_frozen(workdir / FROZEN_BASE, abstract.frozen)
    reference = None
    if abstract.reference is not None:  # DPO: the reference the run saved when it started.
      reference = restore_frozen(workdir / REFERENCE, abstract.reference, _REFERENCE)
    return step.TrainState.from_checkpointed(saved, frozen, reference), progress
  _warn_if_logged_before(workdir, checkpointer)
  state, progress = _initial_state(run, steps, sources, abstract)
  progress = dataclasses.replace(progress, dpo=steps.preference)  # Whatever another run did.
  if state.frozen is not None:  # LoRA: the base, saved once; the checkpoints hold the rest.
    checkpointer.before_save()
    save_frozen(workdir / FROZEN_BASE, state.frozen)
  if abstract.reference is not None:  # DPO: where the policy starts (init, or loaded), saved once.
    copy = jax.jit(step.copied, out_shardings=steps.state_shardings.reference)
    state = state.replace(reference=copy(state.params))
    checkpointer.before_save()
    save_frozen(workdir / REFERENCE, state.reference, _REFERENCE)
  return state, progress


_REFERENCE = "the reference model of this DPO run (its initial params)"


def _check_objective(workdir: epath.Path, progress: Progress, preference: bool) -> None:
  """The data decides whether a run trains by DPO (preference data) or by next-token loss; a
  resume on data of the other kind would switch objective silently."""
  if progress.dpo and not preference:
    raise UserError(f"the run in {workdir} trains by DPO, but its data is no longer preference "
                    f"data (prepare --source=preference); point config.data at its preference "
                    f"data, or use a new --workdir")
  if preference and not progress.dpo:
    raise UserError(f"the run in {workdir} trained by next-token loss, and its data is now "
                    f"preference data, which trains by DPO: start DPO in a new --workdir from "
                    f"this run (config.checkpoint.load_path, or its export as "
                    f"config.trainer.init_from_hf)")


def _initial_state(run: RunConfig, steps: step.ShardedSteps, sources: list[PreparedDataset],
                   abstract: step.TrainState) -> tuple[step.TrainState, Progress]:
  """A run's first state: init, the params (LoRA: the frozen base) of a Hugging Face
  checkpoint (init_from_hf), or another run's (checkpoint.load_path)."""
  trainer = run.trainer
  fresh = (steps.init(jax.random.key(trainer.seed)),
           Progress(DataPosition.start(sources, run.data.reader_groups)))
  if trainer.init_from_hf:
    logging.info("Starting from the Hugging Face checkpoint %s", trainer.init_from_hf)
    if abstract.frozen is not None:  # LoRA: the checkpoint is the base; the adapters are fresh.
      frozen = _params_from_hf(trainer.init_from_hf, run.model, abstract.frozen)
      return fresh[0].replace(frozen=frozen), fresh[1]
    params = _params_from_hf(trainer.init_from_hf, run.model, abstract.params)
    return fresh[0].replace(params=params), fresh[1]
  load = run.checkpoint
  if not load.load_path:
    return fresh
  saved, data = load_other_run(paths.resolve(load.load_path, "config.checkpoint.load_path"),
                               abstract.checkpointed)
  # DPO: the caller copies the reference from the loaded params.
  state = step.TrainState.from_checkpointed(saved)
  logging.info("Starting from %s of %s", load.load_items, load.load_path)
  if load.load_items == "state":
    try:
      return state, Progress.from_json(data)
    except ValueError as e:
      raise UserError(f"config.checkpoint.load_path {load.load_path}: its data item is malformed "
                      f"({e}); load only its params (config.checkpoint.load_items='params')"
                      ) from None
  return fresh[0].replace(params=state.params), fresh[1]


def _params_from_hf(path: str, model_cfg, expected):
  """An HF checkpoint's weights, checked against `expected` (this model's params, LoRA's frozen
  base: ShapeDtypeStructs with shardings) and laid out on the mesh."""
  hf_cfg, params = snapshot.load(paths.resolve(path, "config.trainer.init_from_hf"),
                           model_cfg.compute.scan_layers)
  differences = snapshot.differences(hf_cfg, model_cfg)
  if not differences and jax.tree.structure(params) == jax.tree.structure(expected):
    differences = [f"{partitioning.path_name(p)} {x.shape} (checkpoint) != {e.shape} (config)"
                   for (p, x), e in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                                        jax.tree.leaves(expected)) if x.shape != e.shape]
  if differences:
    raise UserError(f"config.trainer.init_from_hf {path} does not fit this model: "
                    f"{'; '.join(differences)}")
  return jax.device_put(jax.tree.map(lambda x, e: x.astype(e.dtype), params, expected),
                        jax.tree.map(lambda e: e.sharding, expected))


def _logged_history(workdir: epath.Path) -> Optional[history.Run]:
  """The workdir's metrics.jsonl as read by `report`, or None if it has none it can read."""
  path = workdir / "metrics.jsonl"
  if not path.is_file() or not path.read_bytes():  # Opened by a run killed before its first log.
    return None
  try:
    return history.load_run(workdir, workdir.name)
  except UserError as e:
    logging.warning("%s", e)
    return None


def _warn_if_logged_before(workdir: epath.Path, checkpointer: Checkpointer) -> None:
  """A run starting from step 0 where an earlier one logged steps: its checkpoints are gone."""
  if jax.process_index() > 0:  # One reader, one warning.
    return
  history = _logged_history(workdir)
  logged = max((step_num for series in history.series.values() for step_num in series),
               default=0) if history else 0
  if logged:
    logging.warning("Starting from step 0, but %s logged steps up to %d: no usable checkpoint "
                    "of that run is in %s (deleted, set aside as damaged, or none was written "
                    "before it stopped)",
                    workdir / "metrics.jsonl", logged, checkpointer.directory)


def eval_missed(start: Start, workdir: epath.Path, checkpointer: Checkpointer,
                step_num: int) -> bool:
  """Whether `step_num`, restored from this run's own checkpoint, is an eval step that
  metrics.jsonl has no eval for: the run was killed between its checkpoint and its eval."""
  return (any(s.has_validation for s in start.sources)
          and _not_logged(start, workdir, checkpointer, step_num,
                          start.run.trainer.eval_every_steps, "eval/loss"))


def harness_missed(start: Start, workdir: epath.Path, checkpointer: Checkpointer,
                   step_num: int) -> bool:
  """Whether `step_num`, restored from this run's own checkpoint, is a step of the in-run
  harness that metrics.jsonl has no harness/ metric for: the run was killed between its
  checkpoint and the harness's end."""
  every = start.run.trainer.eval_harness_every_steps
  return bool(every) and _not_logged(start, workdir, checkpointer, step_num, every, "harness/")


def _not_logged(start: Start, workdir: epath.Path, checkpointer: Checkpointer, step_num: int,
                every: int, prefix: str) -> bool:
  """Whether `step_num` is this run's newest checkpoint and a step to log a metric named
  `prefix`... at (each `every` steps, and the last), and metrics.jsonl has none at it.
  Process 0 reads the file and tells the others."""
  last = start.run.trainer.num_train_steps
  if not step_num or checkpointer.latest_step != step_num or (step_num % every
                                                              and step_num != last):
    return False
  missed = False
  if jax.process_index() == 0:
    history = _logged_history(workdir)
    logged = history.series if history else {}
    missed = not any(name.startswith(prefix) and step_num in series
                     for name, series in logged.items())
  return bool(multihost_utils.broadcast_one_to_all(np.array(missed)))
