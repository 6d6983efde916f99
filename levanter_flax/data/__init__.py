"""Input: document sources, tokenizers, TFRecord shards, their schedule and the tf.data loader.

TensorFlow is imported only inside this package, and only for the CPU.
"""
import dataclasses
import functools

from levanter_flax import checks


@dataclasses.dataclass(frozen=True)
class DataConfig:
  dataset: str  # A prepared dataset directory, or "stdlib".
  mixture: tuple[tuple[str, str, float], ...]  # (name, dataset, weight); replaces `dataset`.
  tokenizer: str
  cache_dir: str
  validation_fraction: float  # The built-in dataset's.
  num_train_shards: int  # The built-in dataset's.
  on_corrupt_record: str  # fail | skip
  reader_groups: int = 0  # 0: chosen when the run first starts. See position.ReaderGroups.
  # Attention within each packed document, positions restarting at each (step.objective).
  document_masking: bool = True
  # A dataset whose manifest differs from the one a checkpoint's position counts in: read it
  # from its start rather than refuse the resume (position.DataPosition.in_datasets_of).
  restart_changed_datasets: bool = False

  def __post_init__(self):
    checks.ranges(self, "data", {
        "validation_fraction": checks.unit(low_open=True, high_open=True),
        "num_train_shards": checks.at_least(1),
        "reader_groups": checks.at_least(0, "0: chosen when the run first starts")})


@functools.cache
def import_tensorflow():
  """Imports TensorFlow for the input pipeline, hidden from every accelerator."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.config.set_visible_devices([], "GPU")
  tf.config.set_visible_devices([], "TPU")
  return tf
