"""The on-disk format: one tf.train.Example per document, tokens as raw bytes.

Raw little-endian bytes (uint16 when the vocabulary fits, else int32) are
smaller than int64_list varints for large vocabularies and decode with one
tf.io.decode_raw, which keeps the loader cheap.
"""
import os
from typing import Iterable, Iterator

import numpy as np

from levanter_flax.data import import_tensorflow

FEATURE = "tokens"


def token_dtype(vocab_size: int) -> str:
  return "uint16" if vocab_size <= np.iinfo(np.uint16).max + 1 else "int32"


def _example(tokens: np.ndarray, dtype: str) -> bytes:
  tf = import_tensorflow()
  raw = np.asarray(tokens).astype(np.dtype(dtype).newbyteorder("<")).tobytes()
  feature = tf.train.Feature(bytes_list=tf.train.BytesList(value=[raw]))
  return tf.train.Example(features=tf.train.Features(feature={FEATURE: feature})).SerializeToString()


def write_shard(path: str, documents: Iterable[np.ndarray], dtype: str) -> tuple[int, int]:
  """Writes documents to `path` atomically; returns (documents, tokens) written.

  The shard appears under its final name only once complete, so a killed
  writer never leaves a partial file that looks finished.
  """
  tf = import_tensorflow()
  tmp_path = f"{path}.tmp-{os.getpid()}"
  num_documents = num_tokens = 0
  with tf.io.TFRecordWriter(tmp_path) as writer:
    for tokens in documents:
      writer.write(_example(tokens, dtype))
      num_documents += 1
      num_tokens += len(tokens)
  os.replace(tmp_path, path)
  return num_documents, num_tokens


def parse_tokens(record, dtype: str):
  """Decodes one serialized Example into an int32 token vector (a tf op)."""
  tf = import_tensorflow()
  features = tf.io.parse_single_example(record, {FEATURE: tf.io.FixedLenFeature([], tf.string)})
  return tf.cast(tf.io.decode_raw(features[FEATURE], getattr(tf, dtype), little_endian=True), tf.int32)


def read_shard(path: str, dtype: str) -> Iterator[np.ndarray]:
  tf = import_tensorflow()
  for record in tf.data.TFRecordDataset(path).map(lambda r: parse_tokens(r, dtype)):
    yield record.numpy()
