"""Input: a built-in corpus, tokenizers, TFRecord shards and the tf.data loader.

TensorFlow is imported only inside this package, and only for the CPU.
"""
import dataclasses
import functools


@dataclasses.dataclass(frozen=True)
class DataConfig:
  cache_dir: str
  corpus: str
  tokenizer: str
  validation_fraction: float
  num_train_shards: int
  shuffle_buffer_size: int


@functools.cache
def import_tensorflow():
  """Imports TensorFlow for the input pipeline, hidden from every accelerator."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.config.set_visible_devices([], "GPU")
  tf.config.set_visible_devices([], "TPU")
  return tf
