"""The state a run trains from: its newest usable checkpoint, restored with the checkpoint's
data item (Progress); else built: init, a Hugging Face checkpoint's params (init_from_hf) or
another run's (checkpoint.load_path). LoRA's frozen base and DPO's reference are saved once
beside the checkpoints, and restored from there."""
import dataclasses

import jax
from absl import logging
from etils import epath

from levanter_flax.checkpoint.store import (FROZEN_BASE, REFERENCE, Checkpointer, abstract_like,
                                            load_other_run, restore_frozen, save_frozen)
from levanter_flax.config.settings import RunConfig
from levanter_flax.core import paths
from levanter_flax.core.errors import UserError
from levanter_flax.data.manifest import PreparedDataset
from levanter_flax.data.position import DataPosition
from levanter_flax.hf import snapshot
from levanter_flax.parallel import distributed, partitioning
from levanter_flax.training import resume_checks, step
from levanter_flax.training.start import Start


@dataclasses.dataclass(frozen=True)
class Progress:
  """The checkpoint's `data` item: where the input stream is, the skipped-step counts
  (trainer.nan_policy='skip'), which a restart must not reset, and the objective the run trains
  by (objectives.OBJECTIVES' name: its data decides, so a resume on data of another kind must
  not switch silently)."""
  position: DataPosition
  skipped_steps: int = 0
  consecutive_skipped_steps: int = 0
  objective: str = "next_token"
  # spike_policy=rollback: the spikes within the last spike_window steps, (step, windows).
  recent_spikes: tuple[tuple[int, int], ...] = ()

  def to_json(self) -> dict:
    return self.position.to_json() | {"skipped_steps": self.skipped_steps,
                                      "consecutive_skipped_steps": self.consecutive_skipped_steps,
                                      "objective": self.objective,
                                      "dpo": self.objective == "dpo",  # As older versions read.
                                      "recent_spikes": [list(s) for s in self.recent_spikes]}

  @classmethod
  def from_json(cls, value: dict) -> "Progress":
    """Raises ValueError for anything but what to_json writes (the counts: 0 if absent; the
    objective: next_token, as every run before DPO, or "dpo" where an older run wrote dpo:
    true)."""
    position = DataPosition.from_json(value)
    counts = [value.get(key, 0) for key in ("skipped_steps", "consecutive_skipped_steps")]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts):
      raise ValueError(f"not a count of skipped steps: {counts}")
    if not isinstance(value.get("dpo", False), bool):
      raise ValueError(f"dpo is not a boolean: {value['dpo']!r}")
    objective = value.get("objective", "dpo" if value.get("dpo") else "next_token")
    if not isinstance(objective, str):
      raise ValueError(f"objective is not a name: {objective!r}")
    spikes = value.get("recent_spikes", [])
    if not (isinstance(spikes, list) and all(
        isinstance(s, list) and len(s) == 2 and all(type(n) is int for n in s) for s in spikes)):
      raise ValueError(f"not a list of recent spikes: {spikes!r}")
    return cls(position, *counts, objective=objective,
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
  if sources:  # GRPO's position counts prompts, in no dataset.
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
    resume_checks.check_objective(workdir, progress.objective, steps.objective.name)
    frozen = None
    if abstract.frozen is not None:  # LoRA: the base the run saved when it started.
      frozen = restore_frozen(workdir / FROZEN_BASE, abstract.frozen)
    reference = None
    if abstract.reference is not None:  # The reference model the run saved when it started.
      reference = restore_frozen(workdir / REFERENCE, abstract.reference, _REFERENCE)
    return step.TrainState.from_checkpointed(saved, frozen, reference), progress
  resume_checks.warn_if_logged_before(workdir, checkpointer)
  state, progress = _initial_state(run, steps, sources, abstract)
  # Whatever another run did.
  progress = dataclasses.replace(progress, objective=steps.objective.name)
  if state.frozen is not None:  # LoRA: the base, saved once; the checkpoints hold the rest.
    checkpointer.before_save()
    save_frozen(workdir / FROZEN_BASE, state.frozen)
  # The reference model: where the policy starts (init, or loaded), saved once.
  if abstract.reference is not None:
    copy = jax.jit(step.copied, out_shardings=steps.state_shardings.reference)
    state = state.replace(reference=copy(state.params))
    checkpointer.before_save()
    save_frozen(workdir / REFERENCE, state.reference, _REFERENCE)
  return state, progress


_REFERENCE = "the reference model of this run (its initial params)"


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
  # A reference model: the caller copies it from the loaded params.
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
