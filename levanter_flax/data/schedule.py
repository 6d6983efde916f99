"""The order of training windows as arithmetic, so any position is found without reading data.

Each train shard is packed on its own into (tokens + documents) // seq_len
windows (every document ends in EOS), so the manifest alone says how many
windows a shard holds. An epoch visits a process's shards in a seeded order
and each shard's windows in a seeded permutation. Window n of the stream is
therefore located by a little arithmetic over the manifest: resuming at step
1,000,000 reads one shard, the same as resuming at step 1.

A mixture interleaves several such streams in blocks: every block of
`MIXTURE_BLOCK` windows holds each source's fixed share in a seeded order,
so how many windows each source gave up to position n is arithmetic too.
"""
import numpy as np

from levanter_flax.core.errors import UserError

MIXTURE_BLOCK = 2048


def shard_windows(shards: list[dict], seq_len: int) -> np.ndarray:
  """Whole seq_len windows in each shard listed in a manifest split."""
  return np.array([(s["num_tokens"] + s["num_documents"]) // seq_len for s in shards], np.int64)


class ShardOrder:
  """The endless order of one process's shards of one source, and its windows in them."""

  def __init__(self, windows: np.ndarray, seed: tuple[int, ...]):
    self.windows = windows
    self._seed = seed
    self.windows_per_epoch = int(windows.sum())

  def _epoch_order(self, epoch: int) -> np.ndarray:
    return np.random.default_rng([*self._seed, epoch]).permutation(len(self.windows))

  def shuffle_seed(self, epoch: int, shard: int) -> np.ndarray:
    """The stateless-shuffle seed of one shard's windows in one epoch."""
    return np.random.default_rng([*self._seed, epoch, shard, 1]).integers(0, 2**31, size=2)

  def locate(self, window: int) -> tuple[int, int, int]:
    """(epoch, place in that epoch's shard order, windows to skip in that shard) of `window`."""
    epoch, rest = divmod(window, self.windows_per_epoch)
    ends = np.cumsum(self.windows[self._epoch_order(epoch)])
    place = int(np.searchsorted(ends, rest, side="right"))
    return epoch, place, rest - (int(ends[place - 1]) if place else 0)

  def epoch_chunks(self, start: int, index: int) -> tuple[np.ndarray, ...]:
    """(shards, shuffle seeds, windows to skip in each) of the index-th epoch from window `start`."""
    first_epoch, place, skip = self.locate(start)
    epoch = first_epoch + index
    shards = self._epoch_order(epoch)[place if index == 0 else 0:]
    skips = np.zeros(len(shards), np.int32)
    skips[:1] = skip if index == 0 else 0
    kept = self.windows[shards] > skips  # A shard the skip leaves empty gives no chunk.
    shards, skips = shards[kept], skips[kept]
    seeds = np.array([self.shuffle_seed(epoch, int(s)) for s in shards], np.int64).reshape(-1, 2)
    return shards.astype(np.int32), seeds, skips


class Mixture:
  """Which source each window comes from: fixed shares per block, shuffled per block."""

  def __init__(self, names: list[str], weights: list[float], seed: int):
    shares = np.asarray(weights, np.float64) / np.sum(weights) * MIXTURE_BLOCK
    counts = np.floor(shares).astype(np.int64)
    # Largest remainders get the windows that flooring left over.
    leftover = np.argsort(-(shares - counts), kind="stable")[:MIXTURE_BLOCK - counts.sum()]
    counts[leftover] += 1
    for name, count in zip(names, counts):
      if not count:
        raise UserError(f"config.data.mixture.{name}.weight is too small: under 1/{MIXTURE_BLOCK} "
                        f"of the total it would never be sampled")
    self.names, self.counts, self._seed = names, counts, seed

  def block(self, index: int) -> np.ndarray:
    ids = np.repeat(np.arange(len(self.counts)), self.counts)
    return np.random.default_rng([self._seed, index]).permutation(ids)

  def consumed(self, window: int) -> np.ndarray:
    """How many windows each source has given once `window` windows have been drawn."""
    full, rest = divmod(window, MIXTURE_BLOCK)
    return full * self.counts + np.bincount(self.block(full)[:rest], minlength=len(self.counts))

  def choice_block(self, start: int, index: int) -> np.ndarray:
    """Source ids of the index-th block of windows from window `start` on."""
    first, skip = divmod(start, MIXTURE_BLOCK)
    return self.block(first + index)[skip if index == 0 else 0:]
