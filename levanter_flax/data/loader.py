"""The tf.data pipeline: TFRecord shards -> shuffled seq_len windows -> global jax.Arrays.

The shards are dealt to reader groups (see `ReaderGroups`), and each process
reads only its groups' shards. A shard is decoded whole, its documents
joined with EOS and cut into windows, and the windows put in a seeded
permutation; several shards decode in parallel. The order is fixed by
`schedule`, so the stream restarts at any DataPosition after reading at most
one shard per group. A mixture draws each window from one source by the
schedule's blocks. `TrainBatches` turns per-process batches into global
arrays sharded over the activation axis and tracks the position.
"""
import collections
import dataclasses
import functools
import hashlib
import json
from typing import Any, Callable, Iterator, NamedTuple, Optional

import google_crc32c
import jax
import numpy as np
from absl import logging
from etils import epath

from levanter_flax import paths
from levanter_flax.data import DataConfig, import_tensorflow, prepare, schedule, tfrecord
from levanter_flax.data.tokenizers import identity, load_tokenizer
from levanter_flax.errors import UserError

tf = import_tensorflow()

# No function of these pipelines branches on a tensor, so AutoGraph has nothing to rewrite, and
# rewriting them took 1.4 s of every run's start-up. The functions a builder wrapped in this
# creates are left as written too: tf.data reads AutoGraph's status when it wraps them.
_as_written = tf.autograph.experimental.do_not_convert

_SHARDS_DECODED_AHEAD = 4
_DEVICE_PREFETCH = 2
_BATCHES_PREFETCHED = 4  # Elements ready ahead of the device copies.
# Train batches taken from tf.data at a time: each take costs the host about a millisecond
# (an op, its numpy copy, a TF thread's handoff), which a small model's step cannot hide.
_BATCHES_PER_READ = 8


@dataclasses.dataclass(frozen=True)
class Source:
  """One prepared dataset of the run, with its mixture weight."""
  name: str
  directory: epath.Path
  manifest: dict
  weight: float

  def files(self, split: str) -> list[str]:
    return [str(self.directory / shard["file"]) for shard in self.manifest["splits"][split]]

  @functools.cached_property
  def manifest_sha256(self) -> str:
    """Which data this is: prepared again or replaced under the same path, it differs."""
    return hashlib.sha256(json.dumps(self.manifest, sort_keys=True).encode()).hexdigest()

  @property
  def has_validation(self) -> bool:
    return any(s["num_documents"] for s in self.manifest["splits"]["validation"])

  @property
  def validation_tokens_per_byte(self) -> float:
    """Tokens the eval stream predicts (EOS included) per byte of validation text."""
    shards = self.manifest["splits"]["validation"]
    tokens = sum(s["num_tokens"] + s["num_documents"] for s in shards)
    return tokens / max(sum(s["num_text_bytes"] for s in shards), 1)


@dataclasses.dataclass(frozen=True)
class ReaderGroups:
  """Which slice of every global batch this process reads, and from which shards.

  Group g of `count` reads the shards g, g + count, ... of every source and
  supplies rows [g, g + 1) * batch / count of each global batch; a process
  reads its own consecutive groups and nothing else. The batches depend on
  `count` alone: runs on 1 or 8 processes with the same count see the same
  data, and resume on each other's checkpoints exactly.
  """
  count: int
  mine: range

  @classmethod
  def of_process(cls, count: int, process_index: int, process_count: int) -> "ReaderGroups":
    """`count` groups split evenly over the processes."""
    if count % process_count:
      raise UserError(f"this run's {process_count} processes cannot share its {count} reader "
                      f"groups (config.data.reader_groups, fixed when the run first started): "
                      f"run it on a number of processes that divides {count}, or start a new "
                      f"run in a new --workdir")
    per_process = count // process_count
    return cls(count, range(process_index * per_process, (process_index + 1) * per_process))

  def rows_per_group(self, local_batch_size: int, what: str) -> int:
    if local_batch_size % len(self.mine):
      total = local_batch_size * self.count // len(self.mine)
      fitting = [n for n in (total // self.count * self.count, -(-total // self.count) * self.count)
                 if n]
      raise UserError(f"{what} ({total}) must be a multiple of the run's {self.count} reader "
                      f"groups (config.data.reader_groups, fixed when the run first started: "
                      f"its batches depend on it), e.g. {' or '.join(map(str, fitting))}")
    return local_batch_size // len(self.mine)


# Divides the usual batch sizes, and the host counts up to 8: a run started with it resumes
# exactly on 1, 2, 4 or 8 processes.
DEFAULT_READER_GROUPS = 8


def default_reader_groups(batch_size: int, process_count: int, sources: list[Source],
                          seq_len: int) -> int:
  """The reader groups a run starts with unless config.data.reader_groups says otherwise.

  The most, up to DEFAULT_READER_GROUPS (or the process count if that is
  more), that split evenly over the processes and the batch, and whose every
  group has a whole window to read in every source.
  """
  windows = [schedule.shard_windows(s.manifest["splits"]["train"], seq_len) for s in sources]
  fitting = [count for count in range(process_count,
                                      max(DEFAULT_READER_GROUPS, process_count) + 1, process_count)
             if batch_size % count == 0
             and all(w[group::count].sum() for w in windows for group in range(count))]
  return max(fitting, default=process_count)


ONE_GROUP = ReaderGroups(1, range(1))


@dataclasses.dataclass(frozen=True)
class DataPosition:
  """How far each reader group has read: windows drawn in all, and from each source.

  The counts are per reader group, so they mean something only for the
  `reader_groups` they were read with (None: not known, from before it was
  saved), and only in the datasets they were counted in: `datasets` holds each
  source's manifest hash (empty: from before it was saved).
  """
  windows: int
  per_source: dict[str, int]
  reader_groups: Optional[int] = None
  datasets: dict[str, str] = dataclasses.field(default_factory=dict)

  @classmethod
  def start(cls, sources: list[Source], reader_groups: int) -> "DataPosition":
    return cls(0, {s.name: 0 for s in sources}, reader_groups,
               {s.name: s.manifest_sha256 for s in sources})

  def to_json(self) -> dict:
    return {"windows": self.windows, "per_source": dict(self.per_source),
            "reader_groups": self.reader_groups, "datasets": dict(self.datasets)}

  @classmethod
  def from_json(cls, value: dict) -> "DataPosition":
    """Raises ValueError for anything but what to_json writes."""
    try:
      position = cls(value["windows"], dict(value["per_source"]), value.get("reader_groups"),
                     dict(value.get("datasets", {})))
    except (AttributeError, KeyError, TypeError, ValueError):
      raise ValueError(f"not a data position: {value!r}") from None
    counts = [position.windows, *position.per_source.values()]
    if position.reader_groups is not None:
      counts.append(position.reader_groups - 1)
    if (not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts)
        or not all(isinstance(h, str) for h in position.datasets.values())):
      raise ValueError(f"not a data position: {value!r}")
    return position

  def in_datasets_of(self, sources: list[Source], restart_changed: bool) -> "DataPosition":
    """This position in `sources`: refused (UserError) if one of them is not the dataset it
    was counted in, unless `restart_changed`, which reads such a source from its start."""
    if not self.datasets:
      logging.warning("The checkpoint's data position predates dataset hashes: that %s are the "
                      "datasets it counted in is not checked this once",
                      ", ".join(str(s.directory) for s in sources))
    changed = [s for s in sources if self.datasets.get(s.name, s.manifest_sha256)
               != s.manifest_sha256]
    if changed and not restart_changed:
      source = changed[0]
      raise UserError(
          f"dataset {source.directory} is not the one the checkpoint's data position counts in "
          f"(its manifest's sha256 is {source.manifest_sha256[:12]}, was "
          f"{self.datasets[source.name][:12]}): it was prepared again or replaced, and resuming "
          f"would read other data from that position. Point the config at the data the run "
          f"started on, or set config.data.restart_changed_datasets=True to read it from its "
          f"start")
    for source in changed:
      logging.warning("Dataset %s changed since the checkpoint (manifest sha256 %s, was %s); "
                      "reading it from its start (config.data.restart_changed_datasets)",
                      source.directory, source.manifest_sha256[:12],
                      self.datasets[source.name][:12])
    return dataclasses.replace(
        self, per_source={**self.per_source, **{s.name: 0 for s in changed}},
        datasets={**self.datasets, **{s.name: s.manifest_sha256 for s in sources}})


def load_sources(cfg: DataConfig) -> list[Source]:
  """The run's datasets, preparing the built-in one if needed; checks their tokenizer."""
  entries = cfg.mixture or (("train", cfg.dataset, 1.0),)
  wanted = identity(load_tokenizer(cfg.tokenizer))
  sources = []
  for name, dataset, weight in entries:
    if dataset == "stdlib":
      directory = prepare.builtin_dataset(cfg.cache_dir, cfg.tokenizer, cfg.validation_fraction,
                                          cfg.num_train_shards)
    else:
      directory = paths.resolve(dataset, f"config.data.{'mixture' if cfg.mixture else 'dataset'}")
    manifest = prepare.load_manifest(directory)
    found = prepare.manifest_tokenizer(manifest)
    if not found.matches(wanted):
      raise UserError(f"dataset {directory} was tokenized with {found.describe()} "
                      f"(vocab {found.vocab_size}), but config.data.tokenizer {cfg.tokenizer!r} "
                      f"is {wanted.describe()} (vocab {wanted.vocab_size})")
    sources.append(Source(name, directory, manifest, weight))
  return sources


# Records parsed per op while a shard is decoded: one op per document made a 1M-token shard
# take 1.3 s of CPU to decode, which on a small CPU run competes with the train step.
_RECORDS_PER_DECODE = 4096


class DecodedShard(NamedTuple):
  """A shard as read (tf tensors)."""
  tokens: Any  # int32: every readable document, EOS after each.
  records: Any  # The documents read.
  token_bytes: Any  # Their raw token bytes joined, as the manifest's checksum covers them.


def decode_shard(path, manifest: dict) -> DecodedShard:
  """Unreadable records end the shard early rather than the run, and a batch of
  records with one that does not parse, or whose bytes are not whole tokens,
  is left out: the counts then differ from the manifest, which the caller
  checks. The documents' bytes are joined and decoded in one op.
  """
  dtype, eos = getattr(tf, manifest["token_dtype"]), manifest["tokenizer"]["eos_id"]

  def whole_tokens(raw):
    return tf.boolean_mask(raw, tf.strings.length(raw) % dtype.size == 0)

  def add(parts, raw):
    joined, lengths = parts
    return (joined.write(joined.size(), tf.strings.reduce_join(raw)),
            lengths.write(lengths.size(), tf.strings.length(raw) // dtype.size))
  batches = (tf.data.TFRecordDataset(path).ignore_errors().batch(_RECORDS_PER_DECODE)
             .map(tfrecord.token_bytes).ignore_errors().map(whole_tokens))
  joined, lengths = batches.reduce(
      (tf.TensorArray(tf.string, size=0, dynamic_size=True, element_shape=[]),
       tf.TensorArray(tf.int32, size=0, dynamic_size=True, infer_shape=False,
                      element_shape=[None])), add)
  token_bytes = tf.strings.reduce_join(joined.stack())
  tokens = tf.io.decode_raw(token_bytes, dtype, little_endian=True)
  lengths = lengths.concat()
  documents = tf.RaggedTensor.from_row_lengths(tf.cast(tokens, tf.int32), lengths)
  with_eos = tf.concat([documents, tf.fill([tf.size(lengths), 1], eos)], axis=1)
  return DecodedShard(with_eos.flat_values, tf.size(lengths), token_bytes)


def _shard_windows(files: list[str], manifest: dict, seq_len: int, check: "ShardCheck",
                   source_index: int):
  """A tf function: (shard, seed, skip) -> that shard's windows, shuffled, minus the first `skip`.

  `check` compares what was decoded with the manifest on the host; a shard
  that does not match yields no window at all.
  """
  files = tf.constant(files)

  def load(shard, seed, skip):
    stream, records, token_bytes = decode_shard(tf.gather(files, shard), manifest)
    intact = tf.py_function(functools.partial(check, source_index),
                            [shard, records, tf.size(stream), token_bytes], tf.bool)
    num_windows = tf.where(intact, tf.shape(stream)[0] // seq_len, 0)
    windows = tf.reshape(stream[:num_windows * seq_len], [num_windows, seq_len])
    windows = tf.random.experimental.stateless_shuffle(windows, seed)[skip:]
    return {"tokens": windows, "source": tf.fill(tf.shape(windows)[:1], source_index)}
  return load


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

  def __init__(self, sources: list[Source], policy: str, groups: ReaderGroups, seq_len: int):
    self._sources, self._policy, self._groups, self._seq_len = sources, policy, groups, seq_len
    self.records_skipped = 0
    self.error: Optional[UserError] = None
    self._damaged: set[tuple[int, int]] = set()

  def __call__(self, source_index: int, shard, records, tokens, token_bytes) -> bool:
    """Whether the shard decoded to what the manifest says."""
    source, shard = self._sources[source_index], int(shard)
    entry = source.manifest["splits"]["train"][shard]
    problem = decode_mismatch(entry, int(records), int(tokens), token_bytes.numpy(),
                              source.directory / entry["file"], "train",
                              source.manifest["token_dtype"])
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
                    dtype: str) -> str:
  """'' if a shard decoded to the records, tokens (EOS included) and token checksum its
  manifest entry lists (datasets prepared before checksums list none)."""
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
  return ""


def _train_windows(source: Source, index: int, *, seq_len: int, seed: int, start: int,
                   group: int, num_groups: int, check: ShardCheck,
                   decode_ahead: int) -> "tf.data.Dataset":
  """One source's endless window stream for one reader group, from its window `start`: an
  element per shard read, its windows [count, seq_len] and their "source"."""
  shards = source.manifest["splits"]["train"][group::num_groups]
  if not shards:
    raise UserError(f"dataset {source.directory} has {len(source.manifest['splits']['train'])} "
                    f"train shards, fewer than the {num_groups} reader groups "
                    f"(config.data.reader_groups); prepare it again with "
                    f"--num_shards={num_groups} or more")
  order = schedule.ShardOrder(schedule.shard_windows(shards, seq_len), (seed, index))
  if not order.windows_per_epoch:
    everything = source.manifest["splits"]["train"]
    filled = np.count_nonzero(schedule.shard_windows(everything, seq_len))
    raise UserError(f"dataset {source.directory} is too small for the run's {num_groups} reader "
                    f"groups (config.data.reader_groups): {filled} of its {len(everything)} "
                    f"train shards hold a whole {seq_len}-token window "
                    f"({sum(s['num_documents'] for s in everything)} documents in all), and some "
                    f"groups read none of those; prepare it with fewer shards (--num_shards="
                    f"{max(filled, 1)}), or start the run with fewer reader groups")

  def chunks(epoch):
    shards, seeds, skips = order.epoch_chunks(start, epoch)
    return group + shards * num_groups, seeds, skips  # The shards' manifest indices.
  chunk_specs = (tf.TensorSpec([], tf.int32), tf.TensorSpec([2], tf.int64),
                 tf.TensorSpec([], tf.int32))
  files = source.files("train")

  def no_error(*chunk):
    """Once `check.error` is set the stream ends, and its consumer raises the error."""
    return tf.ensure_shape(tf.py_function(lambda: check.error is None, [], tf.bool), [])
  # A group with fewer shards than decode_ahead would decode the same shard for several
  # epochs at once: one epoch ahead is enough, since a whole epoch is read while it decodes.
  windows = _host_blocks(chunks, chunk_specs).take_while(no_error).map(
      _shard_windows(files, source.manifest, seq_len, check, index),
      num_parallel_calls=min(decode_ahead, len(shards)), deterministic=True)
  return windows


@_as_written
def train_dataset(sources: list[Source], *, seq_len: int, local_batch_size: int, seed: int,
                  position: DataPosition, groups: ReaderGroups = ONE_GROUP,
                  check: Optional[ShardCheck] = None,
                  batches_per_element: int = 0) -> "tf.data.Dataset":
  """The seeded, endless stream of this process's batches from `position` on.

  Elements: tokens int32[local_batch_size, seq_len], each group's rows in
  turn, and each row's source index; with batches_per_element, that many
  consecutive batches stacked ([batches_per_element, local_batch_size, ...]).
  Every shard read is checked against its manifest entry by `check` (by
  default, a damaged shard stops the stream).
  """
  check = check or ShardCheck(sources, "fail", groups, seq_len)
  rows = groups.rows_per_group(local_batch_size, "config.trainer.batch_size")
  # Whole shards are decoded ahead: the same few in all, however many groups this process reads.
  decode_ahead = max(1, _SHARDS_DECODED_AHEAD // len(groups.mine))
  batches = _concat_groups([_group_batches(sources, seq_len=seq_len, seed=seed, position=position,
                                           group=g, num_groups=groups.count, check=check,
                                           decode_ahead=decode_ahead, rows=rows)
                            for g in groups.mine])
  if batches_per_element:
    batches = batches.batch(batches_per_element)
  return batches.prefetch(_BATCHES_PREFETCHED).with_options(_pipeline_options())


def _pipeline_options() -> "tf.data.Options":
  options = tf.data.Options()
  # tf.data's map-and-batch fusion loses errors raised upstream of the fused map (TF 2.21):
  # a failed shard check would then leave the stream waiting for ever.
  options.experimental_optimization.map_and_batch_fusion = False
  # Nothing here is left for autotuning to size, and its model thread, which backs off to a
  # minute between optimizations, held each iterator's teardown for up to that long: runs
  # exited 5-25 s after their last step.
  options.autotune.enabled = False
  return options


def _group_batches(sources: list[Source], *, seq_len: int, seed: int, position: DataPosition,
                   group: int, num_groups: int, check: ShardCheck, decode_ahead: int,
                   rows: int) -> "tf.data.Dataset":
  """One reader group's batches of `rows` windows, every source mixed in by the schedule."""
  mixture = schedule.Mixture([s.name for s in sources], [s.weight for s in sources], seed)
  derived = mixture.consumed(position.windows)
  streams = [_train_windows(source, index, seq_len=seq_len, seed=seed,
                            start=position.per_source.get(source.name, int(derived[index])),
                            group=group, num_groups=num_groups, check=check,
                            decode_ahead=decode_ahead)
             for index, source in enumerate(sources)]
  if len(streams) == 1:
    # Slices of each shard's windows, not one element per window: a tenth of the host's work.
    return streams[0].rebatch(rows, drop_remainder=True)
  choices = _host_blocks(lambda block: mixture.choice_block(position.windows, block),
                         tf.TensorSpec([], tf.int64))
  return tf.data.Dataset.choose_from_datasets([s.unbatch() for s in streams], choices).batch(
      rows, drop_remainder=True)


def _host_blocks(block: Callable[[int], Any], spec) -> "tf.data.Dataset":
  """The elements of block(0), block(1), ... (host arrays, one per part of `spec`), forever.

  Not Dataset.from_generator: building one makes TF (2.21) pin glibc's mmap
  threshold at 128 KiB for the whole process (its fix for generator memory
  growth on Python 3.11). XLA:CPU then maps and unmaps every scratch buffer
  over 128 KiB afresh in every op: at the nano shape, 22,000 page faults and
  35 ms of system time per step.
  """
  specs = tf.nest.flatten(spec)

  def computed(index):
    parts = tf.py_function(lambda i: tf.nest.flatten(block(int(i))), [index],
                           [s.dtype for s in specs])
    parts = [tf.ensure_shape(p, [None, *s.shape]) for p, s in zip(parts, specs)]
    return tf.nest.pack_sequence_as(spec, parts)
  return tf.data.Dataset.counter().map(computed).unbatch()


def _concat_groups(batches: list["tf.data.Dataset"]) -> "tf.data.Dataset":
  """The groups' batches side by side: group order is row order."""
  if len(batches) == 1:
    return batches[0]
  return tf.data.Dataset.zip(tuple(batches)).map(
      lambda *parts: {k: tf.concat([p[k] for p in parts], axis=0) for k in parts[0]})


def global_arrays(local_batches: Iterator[tuple[dict, object]], sharding: jax.sharding.Sharding,
                  ahead: int = _DEVICE_PREFETCH) -> Iterator[tuple[dict, object]]:
  """(per-process numpy batch, tag) -> (global jax.Arrays, tag), `ahead` batches in flight.

  Transfers are asynchronous, so keeping a few in flight overlaps the
  host-to-device copy with the running step.
  """
  queue = collections.deque()
  for local, tag in local_batches:
    queue.append(({k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
                   for k, v in local.items()}, tag))
    if len(queue) > ahead:
      yield queue.popleft()
  while queue:
    yield queue.popleft()


class TrainBatches:
  """Global train batches, each with the DataPosition reached once it is consumed.

  Damaged shards are handled by `ShardCheck` per config.data.on_corrupt_record;
  `corrupt_records_skipped` counts the records of those left out. A token id
  outside the model's vocabulary stops the run naming its dataset.
  """

  def __init__(self, sources: list[Source], cfg: DataConfig, *, seq_len: int,
               local_batch_size: int, seed: int, position: DataPosition,
               sharding: jax.sharding.Sharding, vocab_size: int,
               groups: ReaderGroups = ONE_GROUP):
    self._sources, self._position, self._vocab_size = sources, position, vocab_size
    self.groups = groups
    self._check = ShardCheck(sources, cfg.on_corrupt_record, groups, seq_len)
    self._dataset = train_dataset(sources, seq_len=seq_len, local_batch_size=local_batch_size,
                                  seed=seed, position=position, groups=groups, check=self._check,
                                  batches_per_element=_BATCHES_PER_READ)
    self._batches = global_arrays(self._tagged(), sharding)

  @property
  def corrupt_records_skipped(self) -> int:
    return self._check.records_skipped

  def __iter__(self):
    return self._batches

  def __next__(self) -> tuple[dict, DataPosition]:
    return next(self._batches)

  def close(self) -> None:
    """Stops the pipeline now, rather than at interpreter exit, when TF complains."""
    self._batches.close()

  def _tagged(self) -> Iterator[tuple[dict, DataPosition]]:
    position, groups_here = self._position, len(self.groups.mine)
    for batch in self._batches_one_by_one():
      if self._check.error:  # Found while reading ahead: stop now, not when it is reached.
        raise self._check.error
      check_token_ids(batch["tokens"], self._vocab_size,
                       lambda rows: {str(self._sources[i].directory)
                                     for i in batch["source"][rows]})
      # Every group draws the same sources in the same order, so the counts split evenly.
      counts = np.bincount(batch["source"], minlength=len(self._sources)) // groups_here
      position = dataclasses.replace(
          position, windows=position.windows + len(batch["tokens"]) // groups_here,
          per_source={s.name: position.per_source.get(s.name, 0) + int(n)
                      for s, n in zip(self._sources, counts)},
          reader_groups=self.groups.count)
      yield {"tokens": batch["tokens"]}, position
    raise self._check.error or UserError("the train stream ended unexpectedly")

  def _batches_one_by_one(self) -> Iterator[dict]:
    for block in self._dataset.as_numpy_iterator():
      for i in range(len(block["tokens"])):
        yield {key: value[i] for key, value in block.items()}


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
