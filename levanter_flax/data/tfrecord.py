"""The on-disk format: one tf.train.Example per document, tokens as raw bytes.

Raw little-endian bytes (uint16 when the vocabulary fits, else int32) are
smaller than int64_list varints for large vocabularies and decode with one
tf.io.decode_raw, which keeps the loader cheap.

Chat and instruction data (a dataset whose manifest says "loss_weights") also
has a `loss_weights` feature per document: one uint8 (0 or 1) per token and
one more for the EOS the loader appends after it, the weight of each as a
target of the loss. Preference data has codes there instead (dpo.py: 1 the
chosen reply, 2 the rejected). Pretraining data has none: every weight is 1.
"""
import os
from typing import Iterator

import google_crc32c
import numpy as np
from etils import epath

from levanter_flax.core import paths
from levanter_flax.core.lazy_tensorflow import import_tensorflow

FEATURE = "tokens"
WEIGHTS_FEATURE = "loss_weights"


def token_dtype(vocab_size: int) -> str:
  return "uint16" if vocab_size <= np.iinfo(np.uint16).max + 1 else "int32"


def _raw(tokens: np.ndarray, dtype: str) -> bytes:
  return np.asarray(tokens).astype(np.dtype(dtype).newbyteorder("<")).tobytes()


def _example(raw: bytes, raw_weights: bytes | None = None) -> bytes:
  tf = import_tensorflow()
  feature = lambda value: tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))
  features = {FEATURE: feature(raw)}
  if raw_weights is not None:
    features[WEIGHTS_FEATURE] = feature(raw_weights)
  return tf.train.Example(features=tf.train.Features(feature=features)).SerializeToString()


class ShardWriter:
  """Writes documents to `path` atomically: the shard appears only once complete.

  A killed writer leaves at most a `.tmp-<pid>` file, never a partial shard
  under its final name. On gs:// an object appears only when its upload
  completes, so the shard is written under its final name.

  `tokens_crc32c` is the CRC32C of every document's raw token bytes in order,
  which the loader checks as it decodes the shard: a shard of other data
  with the same counts is told apart. With `weighted`, each document comes with
  its loss weights (see the module's docstring), checksummed the same way
  (`loss_weights_crc32c`) and its weighted tokens counted (`num_loss_tokens`).
  """

  def __init__(self, path: epath.Path, dtype: str, weighted: bool = False):
    self.path, self._dtype, self.weighted = path, dtype, weighted
    self._tmp_path = path if paths.is_remote(path) else path.with_name(
        f"{path.name}.tmp-{os.getpid()}")
    self.num_documents = self.num_tokens = self.tokens_crc32c = 0
    self.loss_weights_crc32c = self.num_loss_tokens = 0

  def __enter__(self) -> "ShardWriter":
    self._writer = import_tensorflow().io.TFRecordWriter(str(self._tmp_path))
    return self

  def write(self, tokens: np.ndarray, loss_weights: np.ndarray | None = None) -> None:
    """loss_weights: uint8, one per token and one for the EOS after them (`weighted` only)."""
    raw, raw_weights = _raw(tokens, self._dtype), None
    if self.weighted:
      if loss_weights is None or len(loss_weights) != len(tokens) + 1:
        raise ValueError("a weighted shard needs a weight per token and one for the EOS")
      raw_weights = _raw(loss_weights, "uint8")
      self.loss_weights_crc32c = google_crc32c.extend(self.loss_weights_crc32c, raw_weights)
      self.num_loss_tokens += int(np.count_nonzero(loss_weights))
    self._writer.write(_example(raw, raw_weights))
    self.tokens_crc32c = google_crc32c.extend(self.tokens_crc32c, raw)
    self.num_documents += 1
    self.num_tokens += len(tokens)

  def __exit__(self, exc_type, exc, traceback) -> None:
    self._writer.close()
    if exc_type is None and self._tmp_path != self.path:
      self._tmp_path.replace(self.path)
    elif exc_type is not None and self._tmp_path.exists():  # On gs://, what close() uploaded.
      self._tmp_path.unlink()


def parse_tokens(record, dtype: str):
  """Decodes one serialized Example into an int32 token vector (a tf op)."""
  tf = import_tensorflow()
  features = tf.io.parse_single_example(record, {FEATURE: tf.io.FixedLenFeature([], tf.string)})
  return tf.cast(tf.io.decode_raw(features[FEATURE], getattr(tf, dtype), little_endian=True), tf.int32)


def token_bytes(records):
  """A batch of serialized Examples -> each one's raw token bytes (a tf op)."""
  tf = import_tensorflow()
  return tf.io.parse_example(records, {FEATURE: tf.io.FixedLenFeature([], tf.string)})[FEATURE]


def token_and_weight_bytes(records):
  """A batch of serialized Examples of a weighted shard -> (each one's raw token bytes, its raw
  loss weight bytes) (a tf op)."""
  tf = import_tensorflow()
  parsed = tf.io.parse_example(records, {name: tf.io.FixedLenFeature([], tf.string)
                                         for name in (FEATURE, WEIGHTS_FEATURE)})
  return parsed[FEATURE], parsed[WEIGHTS_FEATURE]


def read_shard(path: str, dtype: str) -> Iterator[np.ndarray]:
  tf = import_tensorflow()
  for record in tf.data.TFRecordDataset(path).map(lambda r: parse_tokens(r, dtype)):
    yield record.numpy()


def read_loss_weights(path: str) -> Iterator[np.ndarray]:
  """Each document's loss weights (uint8, its tokens' and its EOS's) from a weighted shard."""
  tf = import_tensorflow()
  spec = {WEIGHTS_FEATURE: tf.io.FixedLenFeature([], tf.string)}
  for record in tf.data.TFRecordDataset(path):
    raw = tf.io.parse_single_example(record, spec)[WEIGHTS_FEATURE]
    yield np.frombuffer(raw.numpy(), np.uint8)
