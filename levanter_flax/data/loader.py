"""The tf.data pipeline: TFRecord shards -> packed token windows -> global jax.Arrays.

Every process reads its own 1/process_count of the documents, shuffles them
with the run's seed, appends EOS, packs the stream into seq_len windows and
batches to the per-process batch. `global_batches` then assembles the
per-process pieces into one jax.Array sharded over the activation axis.
"""
import collections
import pathlib
from typing import Iterator

import jax
import numpy as np

from levanter_flax.data import import_tensorflow, tfrecord

tf = import_tensorflow()

_DOCUMENT_SHUFFLE_BUFFER = 128


def _pack(documents: "tf.data.Dataset", seq_len: int) -> "tf.data.Dataset":
  """Concatenates documents into one stream and cuts it into seq_len windows.

  A scan carries the unfinished tail from one document to the next, so the
  per-element work is per document and per window, never per token.
  """
  def cut(tail, tokens):
    stream = tf.concat([tail, tokens], axis=0)
    num_windows = tf.shape(stream)[0] // seq_len
    windows = tf.reshape(stream[:num_windows * seq_len], [num_windows, seq_len])
    return stream[num_windows * seq_len:], windows
  return documents.scan(tf.zeros([0], tf.int32), cut).unbatch()


def _documents(directory: pathlib.Path, manifest: dict, split: str, *, shuffle_seed,
               process_index: int, process_count: int) -> "tf.data.Dataset":
  files = [str(directory / shard["file"]) for shard in manifest["splits"][split]]
  eos = manifest["tokenizer"]["eos_id"]
  dtype = manifest["token_dtype"]
  ds = tf.data.Dataset.from_tensor_slices(files)
  if shuffle_seed is not None:
    ds = ds.shuffle(len(files), seed=shuffle_seed, reshuffle_each_iteration=True)
  ds = ds.interleave(tf.data.TFRecordDataset, cycle_length=min(len(files), 8),
                     num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
  ds = ds.shard(process_count, process_index)
  if shuffle_seed is not None:
    ds = ds.shuffle(_DOCUMENT_SHUFFLE_BUFFER, seed=shuffle_seed + 1)
  return ds.map(lambda r: tf.concat([tfrecord.parse_tokens(r, dtype), [eos]], axis=0),
                num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def train_dataset(directory: pathlib.Path, manifest: dict, *, seq_len: int, local_batch_size: int,
                  seed: int, shuffle_buffer_size: int, start_batch: int = 0,
                  process_index: int = 0, process_count: int = 1) -> "tf.data.Dataset":
  """An endless, seeded stream of {'tokens': int32[local_batch_size, seq_len]}.

  The stream is a pure function of the seed, so skipping `start_batch`
  batches resumes it exactly where a run that stopped there left off.
  """
  ds = _documents(directory, manifest, "train", shuffle_seed=seed,
                  process_index=process_index, process_count=process_count).repeat()
  ds = _pack(ds, seq_len)
  if shuffle_buffer_size > 1:
    ds = ds.shuffle(shuffle_buffer_size, seed=seed + 2)
  ds = ds.batch(local_batch_size, drop_remainder=True).skip(start_batch)
  return ds.map(lambda tokens: {"tokens": tokens}).prefetch(tf.data.AUTOTUNE)


def eval_dataset(directory: pathlib.Path, manifest: dict, *, seq_len: int, local_batch_size: int,
                 num_batches: int, process_index: int = 0, process_count: int = 1) -> "tf.data.Dataset":
  """The same `num_batches` validation batches every time it is iterated."""
  ds = _documents(directory, manifest, "validation", shuffle_seed=None,
                  process_index=process_index, process_count=process_count).repeat()
  ds = _pack(ds, seq_len).batch(local_batch_size, drop_remainder=True).take(num_batches)
  return ds.map(lambda tokens: {"tokens": tokens}).prefetch(tf.data.AUTOTUNE)


def global_batches(dataset: "tf.data.Dataset", sharding: jax.sharding.Sharding,
                   device_prefetch: int = 2) -> Iterator[dict[str, jax.Array]]:
  """Turns per-process numpy batches into global jax.Arrays, `device_prefetch` ahead.

  Transfers are asynchronous, so keeping a few batches in flight overlaps the
  host-to-device copy with the running step.
  """
  queue = collections.deque()
  for local in dataset.as_numpy_iterator():
    queue.append({k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
                  for k, v in local.items()})
    if len(queue) > device_prefetch:
      yield queue.popleft()
  while queue:
    yield queue.popleft()
