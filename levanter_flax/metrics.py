"""Metric writers (TensorBoard, console, metrics.jsonl) and throughput accounting."""
import json
import pathlib
import time
from typing import Any, Mapping

import jax
import numpy as np
from clu import metric_writers


class JsonlWriter(metric_writers.MetricWriter):
  """Appends one JSON object per write_scalars call: {"step": N, "time": unix seconds, name: value, ...}."""

  def __init__(self, path: pathlib.Path):
    self._file = open(path, "a", encoding="utf-8")

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    record = {"step": int(step), "time": time.time()}
    record.update({k: float(np.asarray(v)) for k, v in scalars.items()})
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()

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
    self._file.close()


def create_writer(workdir: pathlib.Path) -> metric_writers.MetricWriter:
  """TensorBoard + console on the first process; every other process only logs."""
  if jax.process_index() > 0:
    return metric_writers.create_default_writer(str(workdir), just_logging=True)
  return metric_writers.MultiWriter([
      metric_writers.create_default_writer(str(workdir), asynchronous=False),
      JsonlWriter(workdir / "metrics.jsonl"),
  ])


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
