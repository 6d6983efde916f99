"""Input: document sources, tokenizers, TFRecord shards, their schedule and the tf.data loader.

TensorFlow is imported only inside this package, and only for the CPU.
"""
import dataclasses
from typing import Any

from levanter_flax.core import checks
from levanter_flax.core.errors import UserError
from levanter_flax.core.schema import CHOSEN, setting


def _mixture(key: str, value: Any) -> tuple[tuple[str, str, float], ...]:
  """{name: dict(dataset=..., weight=...)} -> ((name, dataset, weight), ...)."""
  entries = []
  for name, entry in (value.items() if hasattr(value, "items") else [(None, value)]):
    if (not hasattr(entry, "keys") or set(entry.keys()) != {"dataset", "weight"}
        or not isinstance(entry["dataset"], str)
        or not isinstance(entry["weight"], (int, float)) or entry["weight"] <= 0):
      where = key if name is None else f"{key}.{name}"
      raise UserError(f"config key {where} must be dict(dataset=<directory>, weight=<positive "
                      f"number>); got {entry!r}")
    entries.append((name, entry["dataset"], float(entry["weight"])))
  return tuple(entries)


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """The datasets and how they are read (config.data)."""
  dataset: str = setting(
      "stdlib", "A directory written by levanter-flax prepare, or stdlib: the Python "
      "standard library's sources, tokenized into cache_dir on first use")
  mixture: tuple[tuple[str, str, float], ...] = setting(
      (), "Named datasets with weights, replacing dataset when set, e.g. "
      "mixture.code = dict(dataset=\"/data/code\", weight=0.7)", convert=_mixture, written={})
  tokenizer: str = setting(
      "byte", "What the data was tokenized with: byte (256 bytes + EOS, nothing to download), "
      "a tokenizer.json or a SentencePiece .model file")
  cache_dir: str = setting("", "For stdlib; \"\" is ~/.cache/levanter_flax")
  validation_fraction: float = setting(0.02, "For stdlib: documents held out for eval")
  num_train_shards: int = setting(8, "For stdlib: train shards written")
  on_corrupt_record: str = setting(
      "fail", "A train shard that decodes to other counts than its manifest lists: fail stops "
      "naming it; skip leaves it out, counted")
  reader_groups: int = setting(
      0, "Shards are dealt to this many reader groups, each supplying a fixed slice of every "
      "batch; the batches depend on it alone, so a run resumes exactly on any process count "
      "that divides it. 0: chosen when the run first starts (data.position.default_reader_groups)",
      CHOSEN, chosen_when=("data.reader_groups", 0))
  document_masking: bool = setting(
      True, "A token attends only to its own packed document and positions restart at each; "
      "off: attention crosses documents (GPT-2's and nanoGPT's recipe), a little faster")
  restart_changed_datasets: bool = setting(
      False, "A dataset prepared again or replaced under the same path is refused on resume; "
      "True reads it from its start instead")

  def __post_init__(self):
    checks.ranges(self, "data", {
        "validation_fraction": checks.unit(low_open=True, high_open=True),
        "num_train_shards": checks.at_least(1),
        "reader_groups": checks.at_least(0, "0: chosen when the run first starts")})
    if self.on_corrupt_record not in ("fail", "skip"):
      raise UserError(f"config.data.on_corrupt_record must be 'fail' or 'skip'; "
                      f"got {self.on_corrupt_record!r}")
    if self.mixture and self.dataset != "stdlib":
      raise UserError("set config.data.dataset or config.data.mixture, not both")

