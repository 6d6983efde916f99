"""The data-order contract: which slice of every batch a process reads, and how far it read.

`ReaderGroups` deals a dataset's shards and every global batch's rows to a
fixed number of groups, so the batches do not depend on the process count;
`DataPosition` is what a checkpoint records of the stream, per group. Both
are plain data (no TensorFlow): the loader reads by them, training/restore.py checks
them on resume.
"""
import dataclasses
from typing import Optional

from absl import logging

from levanter_flax.data import schedule
from levanter_flax.data.manifest import PreparedDataset
from levanter_flax.core.errors import UserError


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


def default_reader_groups(batch_size: int, process_count: int, sources: list[PreparedDataset],
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
  source's manifest hash (empty: from before it was saved), `directories` where it was read
  (empty: from before that was saved), so that a source moved to another path is named so.
  """
  windows: int
  per_source: dict[str, int]
  reader_groups: Optional[int] = None
  datasets: dict[str, str] = dataclasses.field(default_factory=dict)
  directories: dict[str, str] = dataclasses.field(default_factory=dict)

  @classmethod
  def start(cls, sources: list[PreparedDataset], reader_groups: int) -> "DataPosition":
    return cls(0, {s.name: 0 for s in sources}, reader_groups,
               {s.name: s.manifest_sha256 for s in sources}, _directories(sources))

  def to_json(self) -> dict:
    return {"windows": self.windows, "per_source": dict(self.per_source),
            "reader_groups": self.reader_groups, "datasets": dict(self.datasets),
            "directories": dict(self.directories)}

  @classmethod
  def from_json(cls, value: dict) -> "DataPosition":
    """Raises ValueError for anything but what to_json writes."""
    try:
      position = cls(value["windows"], dict(value["per_source"]), value.get("reader_groups"),
                     dict(value.get("datasets", {})), dict(value.get("directories", {})))
    except (AttributeError, KeyError, TypeError, ValueError):
      raise ValueError(f"not a data position: {value!r}") from None
    counts = [position.windows, *position.per_source.values()]
    if position.reader_groups is not None:
      counts.append(position.reader_groups - 1)
    if (not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts)
        or not all(isinstance(h, str) for h in (*position.datasets.values(),
                                                *position.directories.values()))):
      raise ValueError(f"not a data position: {value!r}")
    return position

  def in_datasets_of(self, sources: list[PreparedDataset], restart_changed: bool) -> "DataPosition":
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
      counted_in = self.directories.get(source.name, str(source.directory))
      if counted_in != str(source.directory):
        raise UserError(
            f"dataset {source.name} is now read from {source.directory}, but the checkpoint's "
            f"data position was counted in {counted_in}, other data (manifest sha256 "
            f"{source.manifest_sha256[:12]}, was {self.datasets[source.name][:12]}): the path "
            f"changed, and resuming would read other data from that position. Point the config "
            f"back at {counted_in}, or set config.data.restart_changed_datasets=True to read "
            f"{source.directory} from its start")
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
        datasets={**self.datasets, **{s.name: s.manifest_sha256 for s in sources}},
        directories={**self.directories, **_directories(sources)})


def _directories(sources: list[PreparedDataset]) -> dict[str, str]:
  return {s.name: str(s.directory) for s in sources}
