"""What a resume checks against the run it resumes, before and after anything is restored: the
config.json its checkpoints were written with (saved_config, check_resumed_config), the
objective its data trains by (check_objective), and what metrics.jsonl says was logged (an eval
or harness a kill cut off, steps logged by checkpoints now gone)."""
import json
from typing import Optional

import jax
import numpy as np
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from levanter_flax import config
from levanter_flax.checkpoint.store import Checkpointer
from levanter_flax.config.settings import RunConfig
from levanter_flax.core import paths
from levanter_flax.core.errors import UserError
from levanter_flax.data.manifest import PreparedDataset
from levanter_flax.monitoring import history


def saved_config(workdir: epath.Path, checkpointer: Checkpointer,
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


def check_resumed_config(run: RunConfig, saved: Optional[dict], workdir: epath.Path) -> list[str]:
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
  if run.rl.prompts and run.rl.beta > 0 and saved.get("rl.beta", 0) == 0:
    raise UserError(f"config.rl.beta was 0 when the run in {workdir} started, so it kept no "
                    f"reference model for the KL: resume with config.rl.beta=0, or start a new "
                    f"--workdir from this run's checkpoint (config.checkpoint.load_path)")
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


def check_objective(workdir: epath.Path, trained_by: str, objective: str) -> None:
  """The run's objective (objectives.OBJECTIVES' names) is what its checkpoints record: a
  resume that would train by another (the data decides between next-token and DPO) would
  switch silently."""
  if trained_by == objective:
    return
  if trained_by == "dpo" and objective == "next_token":
    raise UserError(f"the run in {workdir} trains by DPO, but its data is no longer preference "
                    f"data (prepare --source=preference); point config.data at its preference "
                    f"data, or use a new --workdir")
  raise UserError(f"the run in {workdir} trains by {trained_by}, and this start would train "
                  f"by {objective}: start {objective} in a new --workdir from this run "
                  f"(config.checkpoint.load_path, or its export as config.trainer.init_from_hf)")


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


def warn_if_logged_before(workdir: epath.Path, checkpointer: Checkpointer) -> None:
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


def eval_missed(run: RunConfig, sources: list[PreparedDataset], workdir: epath.Path,
                checkpointer: Checkpointer, step_num: int) -> bool:
  """Whether `step_num`, restored from this run's own checkpoint, is an eval step that
  metrics.jsonl has no eval for: the run was killed between its checkpoint and its eval."""
  return (any(s.has_validation for s in sources)
          and _not_logged(run, workdir, checkpointer, step_num, run.trainer.eval_every_steps,
                          "eval/loss"))


def harness_missed(run: RunConfig, workdir: epath.Path, checkpointer: Checkpointer,
                   step_num: int) -> bool:
  """Whether `step_num`, restored from this run's own checkpoint, is a step of the in-run
  harness that metrics.jsonl has no harness/ metric for: the run was killed between its
  checkpoint and the harness's end."""
  every = run.trainer.eval_harness_every_steps
  return bool(every) and _not_logged(run, workdir, checkpointer, step_num, every, "harness/")


def _not_logged(run: RunConfig, workdir: epath.Path, checkpointer: Checkpointer, step_num: int,
                every: int, prefix: str) -> bool:
  """Whether `step_num` is this run's newest checkpoint and a step to log a metric named
  `prefix`... at (each `every` steps, and the last), and metrics.jsonl has none at it.
  Process 0 reads the file and tells the others."""
  last = run.trainer.num_train_steps
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
