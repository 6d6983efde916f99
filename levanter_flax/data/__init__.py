"""Input: document sources, tokenizers, TFRecord shards, their schedule and the tf.data loader.

TensorFlow is imported only inside this package, and only for the CPU.
"""
import dataclasses
import functools


@dataclasses.dataclass(frozen=True)
class DataConfig:
  dataset: str  # A prepared dataset directory, or "stdlib".
  mixture: tuple[tuple[str, str, float], ...]  # (name, dataset, weight); replaces `dataset`.
  tokenizer: str
  cache_dir: str
  validation_fraction: float  # The built-in dataset's.
  num_train_shards: int  # The built-in dataset's.
  on_corrupt_record: str  # fail | skip
  reader_groups: int = 0  # 0: chosen when the run first starts. See loader.ReaderGroups.


@functools.cache
def import_tensorflow():
  """Imports TensorFlow for the input pipeline, hidden from every accelerator."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.config.set_visible_devices([], "GPU")
  tf.config.set_visible_devices([], "TPU")
  return tf
