"""A run's logged metrics read back from its metrics.jsonl: each key as {step: value}, and the
records of each start of the run (report.py plots them; a resume reads what was logged)."""
import dataclasses
import json

from absl import logging
from etils import epath

from levanter_flax.core.errors import UserError

# The trainer logs this at each start of a run, fresh or resumed; it marks the restarts.
RUN_START = "run/started_at_step"


@dataclasses.dataclass
class Run:
  """One workdir's metrics.jsonl: each key as {step: value}, the newest value per step.

  A resumed run logs again the steps after its checkpoint; with exact resume
  the values are the same, and the later ones are kept.
  """
  name: str
  series: dict[str, dict[int, float]]
  segments: list[list[dict]]  # The records of each start of the run, in order.

  def values(self, key: str) -> list[float]:
    return [value for _, value in sorted(self.series.get(key, {}).items())]

  def points(self, key: str) -> tuple[list[int], list[float]]:
    steps = sorted(self.series.get(key, {}))
    return steps, [self.series[key][s] for s in steps]


def _check_record(record: dict) -> None:
  """Raises for anything the trainer never writes: a step that is no integer, a value no number."""
  if int(record["step"]) != record["step"]:
    raise ValueError("fractional step")
  for key, value in record.items():
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise TypeError(f"{key} is not a number")


def load_run(workdir: epath.Path, name: str) -> Run:
  path = workdir / "metrics.jsonl"
  if not path.is_file():
    raise UserError(f"{workdir} has no metrics.jsonl: not a levanter_flax workdir, or its run "
                    f"has not logged a step yet")
  records = []
  text = path.read_bytes().decode("utf-8", errors="replace")
  lines = text.splitlines()
  for number, line in enumerate(lines, 1):
    try:
      record = json.loads(line)
      _check_record(record)
    except (ValueError, KeyError, TypeError, OverflowError):
      if number == len(lines) and not text.endswith("\n"):
        # A run killed while writing; its next start cuts this line off.
        logging.warning("%s:%d is a torn last record (the run was killed while writing it); "
                        "skipped", path, number)
        continue
      raise UserError(f"{path}:{number} is not a metrics record: {line[:80]!r}") from None
    records.append(record)
  if not records:
    raise UserError(f"{path} is empty: the run has not logged a step yet")
  series: dict[str, dict[int, float]] = {}
  segments: list[list[dict]] = []
  for record in records:
    if RUN_START in record or not segments:
      segments.append([])
    segments[-1].append(record)
    for key, value in record.items():
      if key not in ("step", "time"):
        series.setdefault(key, {})[int(record["step"])] = value
  return Run(name, series, segments)
