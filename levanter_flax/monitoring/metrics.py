"""Metric writers (TensorBoard, console, metrics.jsonl, W&B) and throughput accounting."""
import contextlib
import json
import os
import time
from typing import Any, Callable, Mapping, Optional

import jax
import numpy as np
from absl import logging
from clu import metric_writers
from etils import epath

from levanter_flax.core import paths
from levanter_flax.monitoring import wandb_writer
from levanter_flax.core.errors import UserError
from levanter_flax.monitoring.wandb_config import WandbConfig


class JsonlWriter(metric_writers.MetricWriter):
  """Appends one JSON object per write_scalars call: {"step": N, "time": unix seconds, name: value, ...}.

  A run killed mid-write leaves a torn last line; it is cut off on open, so
  the records that follow start on a line of their own. On gs:// every flush
  uploads the whole file (an object cannot be appended to): a few MB at most.
  """

  def __init__(self, path: epath.Path):
    self._path, self._open = path, contextlib.ExitStack()
    try:
      _cut_torn_tail(path)
      self._file = self._open.enter_context(path.open("a"))
    except OSError as e:
      raise UserError(f"cannot write the metrics file {path}: {e.strerror or e}") from None

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    record = {"step": int(step), "time": time.time()}
    record.update({k: float(np.asarray(v)) for k, v in scalars.items()})
    try:
      self._file.write(json.dumps(record) + "\n")
      self._file.flush()
    except OSError as e:
      raise UserError(f"cannot write the metrics file {self._path}: {e.strerror or e}") from None

  def write_summaries(self, step, values, metadata=None): pass
  def write_images(self, step, images): pass
  def write_videos(self, step, videos): pass
  def write_audios(self, step, audios, *, sample_rate): pass
  def write_texts(self, step, texts): pass
  def write_histograms(self, step, arrays, num_buckets=None): pass
  def write_hparams(self, hparams): pass

  def flush(self) -> None:
    self._file.flush()

  def close(self) -> None:
    self._open.close()


def _cut_torn_tail(path: epath.Path) -> None:
  """Truncates `path` after its last newline, if anything follows it."""
  if not path.exists():
    return
  if paths.is_remote(path):  # An object is rewritten whole; it has no tail to truncate.
    data = path.read_bytes()
    tail_start = data.rfind(b"\n") + 1
    if tail_start < len(data):
      _warn_torn(path, len(data) - tail_start)
      path.write_bytes(data[:tail_start])
    return
  with open(path, "rb+") as f:
    size = f.seek(0, os.SEEK_END)
    tail_start = size
    while tail_start > 0:  # Back to the last newline, a block at a time.
      block_start = max(tail_start - 4096, 0)
      f.seek(block_start)
      newline = f.read(tail_start - block_start).rfind(b"\n")
      if newline >= 0:
        tail_start = block_start + newline + 1
        break
      tail_start = block_start
    if tail_start < size:
      _warn_torn(path, size - tail_start)
      f.truncate(tail_start)


def _warn_torn(path: epath.Path, size: int) -> None:
  logging.warning("%s ends in a torn record (%d bytes, from a run that was killed while "
                  "writing it); cutting it off", path, size)


def create_writer(workdir: epath.Path, may_write: Callable[[], bool] = lambda: True,
                  settings: Optional[Mapping[str, Any]] = None,
                  wandb: Optional[WandbConfig] = None) -> metric_writers.MetricWriter:
  """TensorBoard, metrics.jsonl, the console and, where config.trainer.wandb names a project,
  W&B on the first process; every other process only logs.

  `settings` (the run's, as config.json holds them) go with the scalars: to TensorBoard as
  hparams and to W&B as the run's config, once per writer, which a run opens once per start.
  `may_write` is asked before each write into the workdir: its lock may have been lost
  (locks.JobLock.may_write).
  """
  if jax.process_index() > 0:
    return metric_writers.create_default_writer(str(workdir), just_logging=True)
  jsonl = JsonlWriter(workdir / "metrics.jsonl")  # First: it names a file it cannot write.
  # Next: no TensorBoard events file for a run that W&B stops (not installed, or refused).
  wandb = ([wandb_writer.WandbWriter(workdir, wandb, settings or {})]
           if wandb is not None and wandb.enabled else [])
  tensorboard = metric_writers.SummaryWriter(str(workdir))
  if settings is not None and may_write():
    tensorboard.write_hparams(tensorboard_hparams(settings))
  return _Guarded([metric_writers.LoggingWriter(), tensorboard, jsonl, *wandb], may_write)


def tensorboard_hparams(settings: Mapping[str, Any]) -> dict[str, bool | int | float | str]:
  """`settings` as TensorBoard's hparams take them: a list (a mesh, tags) or None as its JSON."""
  return {key: value if isinstance(value, (bool, int, float, str)) else json.dumps(value)
          for key, value in settings.items()}


class _Guarded(metric_writers.MultiWriter):
  """Writes scalars, the only kind the trainer and clu's ReportProgress write, while
  `may_write()` allows."""

  def __init__(self, writers: list[metric_writers.MetricWriter], may_write: Callable[[], bool]):
    super().__init__(writers)
    self._may_write = may_write

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    if self._may_write():
      super().write_scalars(step, scalars)


class Throughput:
  """Tokens/s since the last measurement, and model TFLOP/s per device and MFU from it."""

  def __init__(self, tokens_per_step: int, step: int, flops_per_token: float = 0.0,
               num_devices: int = 1, peak_flops: float = 0.0):
    self._tokens_per_step = tokens_per_step
    self._flops_per_token, self._num_devices, self._peak = flops_per_token, num_devices, peak_flops
    self.reset(step)

  def reset(self, step: int) -> None:
    """Starts a new interval, e.g. after compilation or an eval that is not training time."""
    self._time, self._step = time.perf_counter(), step

  def measure(self, step: int) -> dict[str, float]:
    elapsed = time.perf_counter() - self._time
    tokens = (step - self._step) * self._tokens_per_step
    self.reset(step)
    tokens_per_second = tokens / max(elapsed, 1e-9)
    flops_per_device = tokens_per_second * self._flops_per_token / self._num_devices
    result = {"train/tokens_per_second": tokens_per_second,
              "train/model_tflops_per_device": flops_per_device / 1e12}
    if self._peak:
      result["train/mfu"] = flops_per_device / self._peak
    return result
