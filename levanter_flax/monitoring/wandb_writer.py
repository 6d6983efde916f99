"""Weights & Biases: the run's scalars and its settings, through a clu MetricWriter.

metrics.create_writer adds a WandbWriter on process 0 when config.trainer.wandb names a project;
the others never talk to W&B. wandb is imported only then: a run without W&B needs none of it.

A restart continues the same W&B run: its id is chosen on the run's first start and kept in
<workdir>/wandb_run_id, and every start opens the run with resume="allow". In offline mode each
start writes its own local run directory under the same id; `wandb sync` joins them.
"""
import os
import re
import secrets
import string
import sys
from typing import Any, Mapping

import numpy as np
from absl import logging
from clu import metric_writers
from etils import epath

from levanter_flax.core import paths
from levanter_flax.core.errors import UserError
from levanter_flax.monitoring.wandb_config import WandbConfig

RUN_ID_FILE = "wandb_run_id"
# What W&B accepts as a run id, kept to the characters that need no quoting anywhere.
_RUN_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def run_id(workdir: epath.Path) -> str:
  """The W&B run id of the run in `workdir`: read from <workdir>/wandb_run_id, else chosen now
  and written there (atomically), so that every restart logs to the same W&B run."""
  path = workdir / RUN_ID_FILE
  if path.exists():
    return _read_run_id(path)
  chosen = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
  try:
    paths.write_atomically(path, chosen + "\n")
  except OSError as e:
    raise UserError(f"cannot write the W&B run id file {path}: {e.strerror or e}") from None
  return chosen


def _read_run_id(path: epath.Path) -> str:
  try:
    text = path.read_text().strip()
  except (OSError, UnicodeDecodeError) as e:
    raise UserError(f"cannot read the W&B run id file {path}: "
                    f"{getattr(e, 'strerror', None) or e}") from None
  if not _RUN_ID.fullmatch(text):
    raise UserError(f"the W&B run id file {path} holds {text[:80]!r}, not a run id (up to 64 "
                    f"letters, digits, '_', '.' or '-'); delete it to start a new W&B run")
  return text


def _import_wandb():
  try:
    import wandb  # pylint: disable=g-import-not-at-top  # Only runs that log to W&B need it.
  except ImportError:
    raise UserError("config.trainer.wandb.project is set but wandb is not installed: "
                    "pip install levanter_flax[wandb]") from None
  return wandb


class WandbWriter(metric_writers.MetricWriter):
  """Logs each write_scalars call to a W&B run at its step; the run's settings are its config.

  Scalars written at one step (train metrics, then the eval's) land in one W&B row. W&B keeps a
  run's steps increasing: a step it already holds (logged before a kill, before the checkpoint
  the run restarted from) is not logged again.
  """

  def __init__(self, workdir: epath.Path, cfg: WandbConfig, settings: Mapping[str, Any]):
    wandb = _import_wandb()
    self._id = run_id(workdir)
    try:
      self._run = wandb.init(
          project=cfg.project, entity=cfg.entity or None, name=cfg.name or workdir.name,
          tags=list(cfg.tags), mode=cfg.mode, id=self._id, resume="allow",
          dir=_local_dir(workdir), config=dict(settings), allow_val_change=True)
    except Exception as e:  # pylint: disable=broad-except  # wandb's errors have no common base.
      raise UserError(f"W&B could not open run {self._id} of project {cfg.project!r} "
                      f"({cfg.mode}): {_first_line(e).rstrip('.')}; "
                      "config.trainer.wandb.mode=offline logs locally, to upload later with "
                      "`wandb sync`") from None
    self._first_new_step = self._run.step  # 0, unless an online run resumes.
    if self._first_new_step:
      logging.info("W&B run %s already holds the steps below %d (logged before this restart); "
                   "logging from there", self._id, self._first_new_step)

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    if step < self._first_new_step:
      return
    self._run.log({k: float(np.asarray(v)) for k, v in scalars.items()}, step=int(step))

  def write_hparams(self, hparams: Mapping[str, Any]) -> None:
    self._run.config.update(dict(hparams), allow_val_change=True)

  def write_summaries(self, step, values, metadata=None): pass
  def write_images(self, step, images): pass
  def write_videos(self, step, videos): pass
  def write_audios(self, step, audios, *, sample_rate): pass
  def write_texts(self, step, texts): pass
  def write_histograms(self, step, arrays, num_buckets=None): pass
  def flush(self) -> None: pass

  def close(self) -> None:
    # Closed by contextlib.closing while an exception (a UserError, a crash) may be on its way
    # out: W&B then marks the run failed rather than finished.
    self._run.finish(exit_code=1 if sys.exc_info()[0] else 0)


def _local_dir(workdir: epath.Path) -> str | None:
  """Where W&B writes its local files: $WANDB_DIR if set, else the workdir (W&B's default, the
  current directory, where the workdir is gs://). Read here, not left to wandb, which reads
  the environment once per process."""
  if os.environ.get("WANDB_DIR"):
    return os.environ["WANDB_DIR"]
  return None if paths.is_remote(workdir) else os.fspath(workdir)


def _first_line(error: Exception) -> str:
  text = str(error).strip()
  return text.splitlines()[0] if text else type(error).__name__
