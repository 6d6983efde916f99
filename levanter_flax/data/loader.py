"""The tf.data pipeline: TFRecord shards -> shuffled seq_len windows -> global jax.Arrays.

The shards are dealt to reader groups (see `position.ReaderGroups`), and each
process reads only its groups' shards. A shard is decoded whole, its documents
joined with EOS and cut into windows, and the windows put in a seeded
permutation; several shards decode in parallel, each checked against its
manifest (`integrity.ShardCheck`). The order is fixed by `schedule`, so the
stream restarts at any DataPosition after reading at most one shard per group.
A mixture draws each window from one source by the schedule's blocks.
`TrainBatches` turns per-process batches into global arrays sharded over the
activation axis and tracks the position. When a dataset has loss weights
(chat and instruction data), every batch carries "loss_weights" (float32,
the tokens' shape: each token's weight as a target), 1 for pretraining data.
"""
import collections
import dataclasses
import functools
from typing import Any, Callable, Iterator, Optional

import jax
import numpy as np

from levanter_flax.core import paths
from levanter_flax.core.lazy_tensorflow import import_tensorflow
from levanter_flax.data import DataConfig, dataset_writer, schedule
from levanter_flax.data.integrity import ShardCheck, check_token_ids, decode_shard
from levanter_flax.data.manifest import PreparedDataset, load_manifest, manifest_tokenizer
from levanter_flax.data.position import ONE_GROUP, DataPosition, ReaderGroups
from levanter_flax.data.tokenizers import identity, load_tokenizer
from levanter_flax.core.errors import UserError

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


def has_loss_weights(sources: list[PreparedDataset]) -> bool:
  """Whether a run's batches carry "loss_weights": when any of its datasets has them (chat and
  instruction data; the others' weights are then all 1)."""
  return any(source.has_loss_weights for source in sources)


def load_datasets(cfg: DataConfig) -> list[PreparedDataset]:
  """The run's datasets, preparing the built-in one if needed; checks their tokenizer."""
  entries = cfg.mixture or (("train", cfg.dataset, 1.0),)
  wanted = identity(load_tokenizer(cfg.tokenizer))
  datasets = []
  for name, dataset, weight in entries:
    if dataset == "stdlib":
      directory = dataset_writer.builtin_dataset(cfg.cache_dir, cfg.tokenizer,
                                                 cfg.validation_fraction, cfg.num_train_shards)
    else:
      directory = paths.resolve(dataset, f"config.data.{'mixture' if cfg.mixture else 'dataset'}")
    manifest = load_manifest(directory)
    found = manifest_tokenizer(manifest)
    if not found.matches(wanted):
      raise UserError(f"dataset {directory} was tokenized with {found.describe()} "
                      f"(vocab {found.vocab_size}), but config.data.tokenizer {cfg.tokenizer!r} "
                      f"is {wanted.describe()} (vocab {wanted.vocab_size})")
    datasets.append(PreparedDataset(name, directory, manifest, weight))
  return datasets


def _shard_windows(files: list[str], manifest: dict, seq_len: int, check: ShardCheck,
                   source_index: int, weighted_run: bool):
  """A tf function: (shard, seed, skip) -> that shard's windows, shuffled, minus the first `skip`.

  `check` compares what was decoded with the manifest on the host; a shard
  that does not match yields no window at all. In a run with loss weights
  (`weighted_run`) each window has its "loss_weights" (uint8), all 1 for a
  dataset without them.
  """
  files = tf.constant(files)
  cut = lambda stream, count: tf.reshape(stream[:count * seq_len], [count, seq_len])

  def load(shard, seed, skip):
    decoded = decode_shard(tf.gather(files, shard), manifest)
    stream = decoded.tokens
    checked = [shard, decoded.records, tf.size(stream), decoded.token_bytes]
    if decoded.weight_bytes is not None:
      checked.append(decoded.weight_bytes)
    intact = tf.py_function(functools.partial(check, source_index), checked, tf.bool)
    num_windows = tf.where(intact, tf.shape(stream)[0] // seq_len, 0)
    windows = cut(stream, num_windows)
    if decoded.loss_weights is None:
      windows = tf.random.experimental.stateless_shuffle(windows, seed)[skip:]
      weights = tf.ones_like(windows, tf.uint8)
    else:  # Shuffled together: [windows, 2, seq_len].
      weights = tf.cast(cut(decoded.loss_weights, num_windows), tf.int32)
      both = tf.random.experimental.stateless_shuffle(tf.stack([windows, weights], 1), seed)[skip:]
      windows, weights = both[:, 0], tf.cast(both[:, 1], tf.uint8)
    element = {"tokens": windows, "source": tf.fill(tf.shape(windows)[:1], source_index)}
    return element | {"loss_weights": weights} if weighted_run else element
  return load


def _train_windows(source: PreparedDataset, index: int, *, seq_len: int, seed: int, start: int,
                   group: int, num_groups: int, check: ShardCheck, decode_ahead: int,
                   weighted_run: bool) -> "tf.data.Dataset":
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
      _shard_windows(files, source.manifest, seq_len, check, index, weighted_run),
      num_parallel_calls=min(decode_ahead, len(shards)), deterministic=True)
  return windows


@_as_written
def train_dataset(sources: list[PreparedDataset], *, seq_len: int, local_batch_size: int, seed: int,
                  position: DataPosition, groups: ReaderGroups = ONE_GROUP,
                  check: Optional[ShardCheck] = None,
                  batches_per_element: int = 0) -> "tf.data.Dataset":
  """The seeded, endless stream of this process's batches from `position` on.

  Elements: tokens int32[local_batch_size, seq_len], each group's rows in
  turn, each row's source index, and when any source has loss weights their
  "loss_weights" (uint8, tokens' shape); with batches_per_element, that many
  consecutive batches stacked ([batches_per_element, local_batch_size, ...]).
  Every shard read is checked against its manifest entry by `check` (by
  default, a damaged shard stops the stream).
  """
  check = check or ShardCheck(sources, "fail", groups, seq_len)
  rows = groups.rows_per_group(local_batch_size, "config.trainer.batch_size")
  # Whole shards are decoded ahead: the same few in all, however many groups this process reads.
  decode_ahead = max(1, _SHARDS_DECODED_AHEAD // len(groups.mine))
  weighted_run = has_loss_weights(sources)
  batches = _concat_groups([_group_batches(sources, seq_len=seq_len, seed=seed, position=position,
                                           group=g, num_groups=groups.count, check=check,
                                           decode_ahead=decode_ahead, rows=rows,
                                           weighted_run=weighted_run)
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


def _group_batches(sources: list[PreparedDataset], *, seq_len: int, seed: int, position: DataPosition,
                   group: int, num_groups: int, check: ShardCheck, decode_ahead: int,
                   rows: int, weighted_run: bool) -> "tf.data.Dataset":
  """One reader group's batches of `rows` windows, every source mixed in by the schedule."""
  mixture = schedule.Mixture([s.name for s in sources], [s.weight for s in sources], seed)
  derived = mixture.consumed(position.windows)
  streams = [_train_windows(source, index, seq_len=seq_len, seed=seed,
                            start=position.per_source.get(source.name, int(derived[index])),
                            group=group, num_groups=num_groups, check=check,
                            decode_ahead=decode_ahead, weighted_run=weighted_run)
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

  def __init__(self, sources: list[PreparedDataset], cfg: DataConfig, *, seq_len: int,
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
      yield {"tokens": batch["tokens"], **({"loss_weights": batch["loss_weights"].astype(
          np.float32)} if "loss_weights" in batch else {})}, position
    raise self._check.error or UserError("the train stream ended unexpectedly")

  def _batches_one_by_one(self) -> Iterator[dict]:
    for block in self._dataset.as_numpy_iterator():
      for i in range(len(block["tokens"])):
        yield {key: value[i] for key, value in block.items()}
