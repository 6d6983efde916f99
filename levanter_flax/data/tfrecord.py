"""The on-disk format: one tf.train.Example per document, tokens as raw bytes.

Raw little-endian bytes (uint16 when the vocabulary fits, else int32) are
smaller than int64_list varints for large vocabularies and decode with one
tf.io.decode_raw, which keeps the loader cheap.
"""
import os
from typing import Iterator

import google_crc32c
import numpy as np
from etils import epath

from levanter_flax import paths
from levanter_flax.data import import_tensorflow

FEATURE = "tokens"


def token_dtype(vocab_size: int) -> str:
  return "uint16" if vocab_size <= np.iinfo(np.uint16).max + 1 else "int32"


def _raw(tokens: np.ndarray, dtype: str) -> bytes:
  return np.asarray(tokens).astype(np.dtype(dtype).newbyteorder("<")).tobytes()


def _example(raw: bytes) -> bytes:
  tf = import_tensorflow()
  feature = tf.train.Feature(bytes_list=tf.train.BytesList(value=[raw]))
  return tf.train.Example(features=tf.train.Features(feature={FEATURE: feature})).SerializeToString()


class ShardWriter:
  """Writes documents to `path` atomically: the shard appears only once complete.

  A killed writer leaves at most a `.tmp-<pid>` file, never a partial shard
  under its final name. On gs:// an object appears only when its upload
  completes, so the shard is written under its final name.

  `tokens_crc32c` is the CRC32C of every document's raw token bytes in order,
  which the loader checks as it decodes the shard: a shard of other data
  with the same counts is told apart.
  """

  def __init__(self, path: epath.Path, dtype: str):
    self.path, self._dtype = path, dtype
    self._tmp_path = path if paths.is_remote(path) else path.with_name(
        f"{path.name}.tmp-{os.getpid()}")
    self.num_documents = self.num_tokens = self.tokens_crc32c = 0

  def __enter__(self) -> "ShardWriter":
    self._writer = import_tensorflow().io.TFRecordWriter(str(self._tmp_path))
    return self

  def write(self, tokens: np.ndarray) -> None:
    raw = _raw(tokens, self._dtype)
    self._writer.write(_example(raw))
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


def read_shard(path: str, dtype: str) -> Iterator[np.ndarray]:
  tf = import_tensorflow()
  for record in tf.data.TFRecordDataset(path).map(lambda r: parse_tokens(r, dtype)):
    yield record.numpy()
