"""The eval set: a fixed list of windows spread evenly over a source's whole validation split.

The validation split is read as one stream, its shards in manifest order and
each document followed by EOS (as the train stream joins them), cut into
seq_len windows. The eval set is `num_windows` of them at an even stride, so it
samples every part of the split, and it depends on the data, seq_len and its
size alone: not on the batch size, accumulation, reader groups or process
count. Every eval scores the same windows, so curves and sweeps compare.

Each process holds a contiguous share of the set and decodes only the shards
under it; a global eval batch is every process's next rows, the last one
padded with rows that are scored and then left out.

A dataset with loss weights (chat and instruction data) scores only its
weighted tokens: the loss is their mean, whichever windows they fall in. A
preference dataset's windows are its pairs (each document one window), scored
by DPO (`evaluate_pairs`).
"""
import dataclasses
import functools
import math
from typing import Iterator

import jax
import numpy as np
from absl import logging

from levanter_flax.core import progress
from levanter_flax.core.lazy_tensorflow import import_tensorflow
from levanter_flax.data import integrity, loader
from levanter_flax.data.manifest import PreparedDataset
from levanter_flax.core.errors import UserError

tf = import_tensorflow()


def spread(total: int, count: int) -> np.ndarray:
  """`count` of the indices 0..total-1 at an even stride, each in the middle of its stretch."""
  return ((np.arange(count) + 0.5) * total / count).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class EvalSet:
  """This process's share of one source's eval set: windows int32[share, seq_len]."""
  source: PreparedDataset
  num_windows: int  # In the whole set, every process's share.
  windows: np.ndarray
  process_index: int
  process_count: int
  loss_weights: np.ndarray | None = None  # float32, windows' shape; None: all 1.

  def _share_sizes(self) -> np.ndarray:
    return np.array([len(s) for s in np.array_split(np.arange(self.num_windows),
                                                      self.process_count)])

  def num_batches(self, rows_per_process: int) -> int:
    return -(-int(self._share_sizes().max()) // rows_per_process)

  def local_batches(self, rows_per_process: int) -> Iterator[dict]:
    """This process's rows of each global batch, the last padded."""
    padded = np.zeros((self.num_batches(rows_per_process) * rows_per_process,
                       self.windows.shape[1]), np.int32)
    padded[:len(self.windows)] = self.windows
    weights = None
    if self.loss_weights is not None:
      weights = np.zeros(padded.shape, np.float32)
      weights[:len(self.loss_weights)] = self.loss_weights
    for start in range(0, len(padded), rows_per_process):
      rows = slice(start, start + rows_per_process)
      yield {"tokens": padded[rows], **({} if weights is None else {"loss_weights": weights[rows]})}

  def scored(self, process_rows: list[np.ndarray]) -> np.ndarray:
    """Which rows of the global batches, concatenated, hold a window of the set (the rest pad),
    where process p's local rows land at rows process_rows[p] of each global batch."""
    rows_per_process = len(process_rows[0])
    batch_size = rows_per_process * self.process_count
    scored = np.zeros(self.num_batches(rows_per_process) * batch_size, bool)
    for share, rows in zip(self._share_sizes(), process_rows):
      local = np.arange(len(scored) // self.process_count)  # This process's rows, in order.
      batch, row = np.divmod(local, rows_per_process)
      scored[batch * batch_size + rows[row]] = local < share
    return scored


def process_rows(sharding: jax.sharding.Sharding, batch_size: int,
                 process_count: int) -> list[np.ndarray]:
  """Which rows of a global batch each process's local rows become, in order, as
  make_array_from_process_local_data places them: the mesh decides, not the process index."""
  rows = [set() for _ in range(process_count)]
  for device, index in sharding.devices_indices_map((batch_size, 1)).items():
    rows[device.process_index].update(range(*index[0].indices(batch_size)))
  return [np.array(sorted(r)) for r in rows]


def num_windows(source: PreparedDataset, seq_len: int, eval_tokens: int | str) -> int:
  """How many windows the eval set holds: eval_tokens' worth, or all the split holds if that is
  less ("all": every one). A split without a whole window is refused."""
  available = _stream_tokens(source) // seq_len
  if not available:
    raise UserError(f"the validation split of {source.directory} holds "
                    f"{_stream_tokens(source)} tokens (EOS included), less than one window of "
                    f"config.model.seq_len {seq_len}: nothing to evaluate; prepare it with a "
                    f"larger --validation_fraction")
  return available if eval_tokens == "all" else min(-(-eval_tokens // seq_len), available)


def build(source: PreparedDataset, *, seq_len: int, eval_tokens: int | str, vocab_size: int,
          process_index: int, process_count: int) -> EvalSet:
  """This process's share of the source's eval set, read and checked now, before training.

  The shards it reads are checked against the manifest: damage there stops the
  run, as an eval over other data would not compare with the evals before it.
  """
  count, available = num_windows(source, seq_len, eval_tokens), _stream_tokens(source) // seq_len
  if eval_tokens != "all" and count == available and count * seq_len < eval_tokens:
    logging.warning("config.trainer.eval_tokens %d is more than the validation split of %s "
                    "holds in %d-token windows (%d); evaluating on all of it", eval_tokens,
                    source.directory, seq_len, available * seq_len)
  chosen = spread(available, count)
  share = np.array_split(chosen, process_count)[process_index]
  windows = _read_windows(source, share, seq_len, _decoder(source))
  weights = None
  if source.has_loss_weights:  # Read together: [share, seq_len, 2].
    windows, weights = windows[..., 0], windows[..., 1].astype(np.float32)
  if len(windows):
    integrity.check_token_ids(windows, vocab_size,
                              lambda rows: {f"{source.directory} (validation)"})
  return EvalSet(source, count, windows, process_index, process_count, weights)


def _stream_tokens(source: PreparedDataset) -> int:
  return sum(_shard_lengths(source))


def _shard_lengths(source: PreparedDataset) -> list[int]:
  """Each validation shard's tokens, EOS included."""
  return [s["num_tokens"] + s["num_documents"] for s in source.manifest["splits"]["validation"]]


def _read_windows(source: PreparedDataset, indices: np.ndarray, seq_len: int,
                  decode) -> np.ndarray:
  """Windows `indices` (ascending) of the validation stream, decoding each shard under them once;
  int32[indices, seq_len], and [..., 2] with loss weights (`decode`'s per token)."""
  ends = np.cumsum(_shard_lengths(source))
  starts = ends - _shard_lengths(source)
  decoded: dict[int, np.ndarray] = {}
  windows = np.zeros((len(indices), seq_len, *[2] * source.has_loss_weights), np.int32)
  for row, index in enumerate(indices):
    first, last = index * seq_len, (index + 1) * seq_len
    shards = range(int(np.searchsorted(ends, first, side="right")),
                   int(np.searchsorted(starts, last, side="left")))
    decoded = {i: tokens for i, tokens in decoded.items() if i in shards}  # Behind us: drop.
    for shard in shards:
      if shard not in decoded:
        decoded[shard] = decode(shard)
    windows[row] = np.concatenate([decoded[i][max(first - starts[i], 0):last - starts[i]]
                                   for i in shards])
  return windows


def _decoder(source: PreparedDataset):
  """shard index -> that validation shard's tokens, EOS after each document (with loss weights:
  [tokens, 2], each token and its weight), checked against its manifest entry."""
  # In a graph, as in the train stream: eagerly, an empty TensorArray cannot be concatenated.
  decode = tf.function(functools.partial(integrity.decode_shard, manifest=source.manifest),
                       autograph=False)

  def checked(shard: int) -> np.ndarray:
    path = source.files("validation")[shard]
    decoded = decode(tf.constant(path))  # A tensor: one trace for every shard.
    problem = integrity.decode_mismatch(
        source.manifest["splits"]["validation"][shard], int(decoded.records),
        int(tf.size(decoded.tokens)), decoded.token_bytes.numpy(), path, "validation",
        source.manifest["token_dtype"],
        None if decoded.weight_bytes is None else decoded.weight_bytes.numpy())
    if problem:
      raise UserError(f"{problem}; prepare the data again (damaged validation shards always "
                      f"stop the run: an eval over other data would not compare)")
    if decoded.loss_weights is None:
      return decoded.tokens.numpy()
    return np.stack([decoded.tokens.numpy(), decoded.loss_weights.numpy().astype(np.int32)], 1)
  return checked


def evaluate(eval_set: EvalSet, eval_step, params, batch_size: int,
             sharding: jax.sharding.Sharding) -> tuple[float, float, float]:
  """(mean loss over the set's scored tokens, its standard error, how many tokens), the same
  on every process.

  Every window predicts seq_len - 1 tokens, so the mean over windows is the
  mean over tokens; windows are the units of the error, as their tokens are
  not independent. With loss weights the windows score different numbers of
  tokens: the mean is their total over their weight, its error a ratio
  estimate's (the delta method), which is the former's when every window's
  weight is the same.
  """
  per_window = _scored_outputs(eval_set, eval_step, params, batch_size, sharding)
  if eval_set.loss_weights is None:
    tokens = eval_set.num_windows * (eval_set.windows.shape[1] - 1)
    return float(per_window.mean()), _standard_error(per_window), float(tokens)
  sums, weights = per_window
  total = weights.sum()
  if not total:
    raise UserError(f"the eval set of {eval_set.source.directory} holds no token with a loss "
                    f"weight; raise config.trainer.eval_tokens")
  loss = sums.sum() / total
  count = len(sums)
  stderr = (math.sqrt(count / (count - 1) * np.sum((sums - loss * weights) ** 2)) / total
            if count > 1 else math.nan)
  return float(loss), float(stderr), float(total)


def evaluate_pairs(eval_set: EvalSet, eval_step, params, batch_size: int,
                   sharding: jax.sharding.Sharding) -> tuple[dict[str, float], float]:
  """(the mean of each of eval_step's per-window outputs over a preference eval set, whose every
  window is a pair: DPO's "loss" and the dpo/ metrics; the loss's standard error), the same on
  every process."""
  pairs = _scored_outputs(eval_set, eval_step, params, batch_size, sharding)
  return ({name: float(values.mean()) for name, values in pairs.items()},
          _standard_error(pairs["loss"]))


# Eval batches dispatched ahead of the device at most (as the train loop's steps).
_MAX_BATCHES_AHEAD = 8


def _scored_outputs(eval_set: EvalSet, eval_step, params, batch_size: int,
                    sharding: jax.sharding.Sharding):
  """eval_step's output for the set's windows (a tree of per-window arrays), in float64,
  every batch's concatenated and the padding left out."""
  rows = process_rows(sharding, batch_size, eval_set.process_count)
  batches = loader.global_arrays(
      ((batch, None) for batch in eval_set.local_batches(len(rows[0]))), sharding)
  outputs = []
  for batch, _ in progress.iterate(batches, f"eval {eval_set.source.name}",
                                   total=eval_set.num_batches(len(rows[0])), unit="batches",
                                   shown=jax.process_index() == 0):
    outputs.append(eval_step(params, batch))
    if len(outputs) > _MAX_BATCHES_AHEAD:
      # Unbounded, dozens of steps in flight on a CPU split into devices starve XLA's thread
      # pool: each one's collective waits for devices whose threads run the others (deadlock).
      jax.block_until_ready(outputs[-_MAX_BATCHES_AHEAD - 1])
  scored = eval_set.scored(rows)
  return jax.tree.map(lambda *parts: np.concatenate(parts).astype(np.float64)[scored],
                      *jax.device_get(outputs))


def _standard_error(values: np.ndarray) -> float:
  return float(values.std(ddof=1) / math.sqrt(len(values)) if len(values) > 1 else math.nan)
