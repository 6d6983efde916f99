"""Is the data what its manifest says: each shard decoded and checked, token ids in range.

A shard is decoded whole (`decode_shard`) and its records, tokens and token
CRC32C compared with its manifest entry (`decode_mismatch`): the train stream
does so for each shard it reads (`ShardCheck`), the eval set for each
validation shard. `check_token_ids` refuses ids the model has no row for.
"""
from typing import Any, NamedTuple, Optional

import google_crc32c
import numpy as np
from absl import logging

from levanter_flax.core.lazy_tensorflow import import_tensorflow

from levanter_flax.data import schedule, tfrecord
from levanter_flax.data.manifest import PreparedDataset, has_loss_weights
from levanter_flax.data.position import ReaderGroups
from levanter_flax.core.errors import UserError

tf = import_tensorflow()

# Records parsed per op while a shard is decoded: one op per document made a 1M-token shard
# take 1.3 s of CPU to decode, which on a small CPU run competes with the train step.
_RECORDS_PER_DECODE = 4096


class DecodedShard(NamedTuple):
  """A shard as read (tf tensors)."""
  tokens: Any  # int32: every readable document, EOS after each.
  records: Any  # The documents read.
  token_bytes: Any  # Their raw token bytes joined, as the manifest's checksum covers them.
  # A weighted dataset's (else None): uint8, tokens' shape, each token's loss weight.
  loss_weights: Any = None
  weight_bytes: Any = None  # Their raw bytes joined, as the manifest's checksum covers them.


def decode_shard(path, manifest: dict) -> DecodedShard:
  """Unreadable records end the shard early rather than the run, and a batch of
  records with one that does not parse, or whose bytes are not whole tokens
  (or, with loss weights, not one weight per token and EOS), is left out: the
  counts then differ from the manifest, which the caller checks. The
  documents' bytes are joined and decoded in one op.
  """
  dtype, eos = getattr(tf, manifest["token_dtype"]), manifest["tokenizer"]["eos_id"]
  weighted = has_loss_weights(manifest)

  def whole_tokens(raw, *raw_weights):
    """(raw, [raw weights]) of the records whose bytes are whole tokens [and their weights]."""
    whole = tf.strings.length(raw) % dtype.size == 0
    if weighted:
      whole &= tf.strings.length(raw_weights[0]) == tf.strings.length(raw) // dtype.size + 1
    return tuple(tf.boolean_mask(part, whole) for part in (raw, *raw_weights))

  def add(parts, raw_parts):
    joined, lengths = parts[:-1], parts[-1]
    return (*(array.write(array.size(), tf.strings.reduce_join(raw))
              for array, raw in zip(joined, raw_parts)),
            lengths.write(lengths.size(), tf.strings.length(raw_parts[0]) // dtype.size))
  parse = tfrecord.token_and_weight_bytes if weighted else lambda r: (tfrecord.token_bytes(r),)
  batches = (tf.data.TFRecordDataset(path).ignore_errors().batch(_RECORDS_PER_DECODE)
             .map(parse).ignore_errors().map(whole_tokens))
  joined = lambda: tf.TensorArray(tf.string, size=0, dynamic_size=True, element_shape=[])
  *joined, lengths = batches.reduce(
      (*(joined() for _ in range(1 + weighted)),
       tf.TensorArray(tf.int32, size=0, dynamic_size=True, infer_shape=False,
                      element_shape=[None])), add)
  token_bytes = tf.strings.reduce_join(joined[0].stack())
  tokens = tf.io.decode_raw(token_bytes, dtype, little_endian=True)
  lengths = lengths.concat()
  documents = tf.RaggedTensor.from_row_lengths(tf.cast(tokens, tf.int32), lengths)
  with_eos = tf.concat([documents, tf.fill([tf.size(lengths), 1], eos)], axis=1)
  if not weighted:
    return DecodedShard(with_eos.flat_values, tf.size(lengths), token_bytes)
  weight_bytes = tf.strings.reduce_join(joined[1].stack())
  return DecodedShard(with_eos.flat_values, tf.size(lengths), token_bytes,
                      tf.io.decode_raw(weight_bytes, tf.uint8), weight_bytes)


class ShardCheck:
  """Every train shard as decoded against its manifest entry: records, and tokens with EOS.

  Runs on the host (tf.py_function) once per shard read, and never raises
  there: TF would log the traceback. A shard that does not match (a
  truncated or corrupt file, tokens of another dtype) yields no window. With
  on_corrupt_record='fail' that sets `error`; with 'skip' it is counted and
  warned about once (the reads ahead into later epochs would otherwise count
  it again, as timing allows), and `error` is set only once every shard a
  reader group reads is damaged, when no window can ever come. Once `error` is set the
  shard schedule stops, so the stream ends rather than wait for ever, and
  its consumer raises `error`.
  """

  def __init__(self, sources: list[PreparedDataset], policy: str, groups: ReaderGroups, seq_len: int):
    self._sources, self._policy, self._groups, self._seq_len = sources, policy, groups, seq_len
    self.records_skipped = 0
    self.error: Optional[UserError] = None
    self._damaged: set[tuple[int, int]] = set()

  def __call__(self, source_index: int, shard, records, tokens, token_bytes,
               weight_bytes=None) -> bool:
    """Whether the shard decoded to what the manifest says."""
    source, shard = self._sources[source_index], int(shard)
    entry = source.manifest["splits"]["train"][shard]
    problem = decode_mismatch(entry, int(records), int(tokens), token_bytes.numpy(),
                              source.directory / entry["file"], "train",
                              source.manifest["token_dtype"],
                              None if weight_bytes is None else weight_bytes.numpy())
    if not problem:
      return True
    if self._policy == "fail":
      self.error = self.error or UserError(f"{problem}; set config.data.on_corrupt_record='skip' "
                                           f"to leave damaged shards out")
      return False
    if (source_index, shard) not in self._damaged:  # Once, not once per epoch read ahead.
      logging.warning("%s; left out (config.data.on_corrupt_record='skip')", problem)
      self.records_skipped += entry["num_documents"]
      self._damaged.add((source_index, shard))
      self._check_some_left(source_index)
    return False

  def _check_some_left(self, source_index: int) -> None:
    source = self._sources[source_index]
    shards = source.manifest["splits"]["train"]
    windows = schedule.shard_windows(shards, self._seq_len)
    for group in self._groups.mine:
      if all((source_index, i) in self._damaged or not windows[i]
             for i in range(group, len(shards), self._groups.count)):
        self.error = UserError(f"every train shard of {source.directory} that reader group "
                               f"{group} reads is damaged: nothing is left to train on")


def decode_mismatch(entry: dict, records: int, tokens: int, token_bytes: bytes, path, split: str,
                    dtype: str, weight_bytes: Optional[bytes] = None) -> str:
  """'' if a shard decoded to the records, tokens (EOS included) and token checksum its
  manifest entry lists (datasets prepared before checksums list none), and, with loss
  weights, to its weights' checksum."""
  expected = (entry["num_documents"], entry["num_tokens"] + entry["num_documents"])
  if (records, tokens) != expected:
    # Shards of another token dtype decode to twice or half the tokens, EOS aside.
    other_dtype = records == expected[0] and tokens - records in (2 * entry["num_tokens"],
                                                                  entry["num_tokens"] / 2)
    return (f"damaged {split} shard {path}: it decodes to {records} records and {tokens} tokens "
            f"(EOS included), but its manifest lists {expected[0]} and {expected[1]}"
            + (f"; were its tokens written with another dtype than the manifest's {dtype}?"
               if other_dtype else ""))
  checksum = entry.get("tokens_crc32c")
  if checksum is not None and google_crc32c.value(token_bytes) != checksum:
    return (f"{split} shard {path} is not the one its manifest lists: its tokens' CRC32C is "
            f"{google_crc32c.value(token_bytes)}, the manifest's {checksum} (the same counts, "
            f"other tokens: a shard of other data, or damaged)")
  if weight_bytes is not None and google_crc32c.value(weight_bytes) != entry["loss_weights_crc32c"]:
    return (f"{split} shard {path} is not the one its manifest lists: its loss weights' CRC32C is "
            f"{google_crc32c.value(weight_bytes)}, the manifest's {entry['loss_weights_crc32c']} "
            f"(damaged, or prepared otherwise)")
  return ""


def check_token_ids(tokens: np.ndarray, vocab_size: int, datasets_of) -> None:
  """Refuses ids outside [0, vocab_size): they would surface as a non-finite loss."""
  low, high = int(tokens.min()), int(tokens.max())
  if low >= 0 and high < vocab_size:
    return
  rows = np.flatnonzero(((tokens < 0) | (tokens >= vocab_size)).any(axis=1))
  bad = high if high >= vocab_size else low
  raise UserError(f"token id {bad} in {', '.join(sorted(datasets_of(rows)))} is outside "
                  f"config.model.vocab_size ({vocab_size}): the data does not match the model "
                  f"(another tokenizer, or damaged shards)")
