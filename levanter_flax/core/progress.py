"""Progress of long work (prepare, eval, the harness, export, aot): a bar on a terminal, and a
line every so often in a log file, without a bar's carriage returns.

    with progress.Progress("prepare", total=8, unit="shards", counters=("documents", "MB")) as bar:
      bar.advance(documents=1000, MB=2.5)  # Counted work: shown with its rate.
      bar.advance(1)                        # One of the 8 done: the ETA comes from these.

A ticker thread redraws the bar, or writes the line, while the work is silent (a compile, a
shard being written), so a long wait still shows its elapsed time.
"""
import contextlib
import sys
import threading
import time
from typing import Iterable, Iterator, TypeVar

from absl import logging

T = TypeVar("T")

# How often a log file gets a line: often enough to show life, rarely enough to stay readable.
LOG_EVERY_SECONDS = 30.0
_REDRAW_EVERY_SECONDS = 1.0


def on_terminal() -> bool:
  return sys.stderr.isatty()


def _duration(seconds: float) -> str:
  seconds = int(seconds)
  return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
  """`total` units of work (None: unknown), with counters shown with their rates.

  shown=False (a process other than 0) shows nothing and costs nothing but the counting. In a
  log file, work shorter than log_every_seconds writes no line unless `summary`: a line at its end.
  """

  def __init__(self, what: str, total: int | None = None, unit: str = "", *,
               counters: Iterable[str] = (), shown: bool = True, summary: bool = False,
               log_every_seconds: float = LOG_EVERY_SECONDS):
    self.what, self.total, self.unit = what, total, unit
    self.done = 0
    self.counts = dict.fromkeys(counters, 0.0)
    self._start = time.monotonic()
    self._lock = threading.Lock()
    self._closed = threading.Event()
    self._bar = None
    self._last_line, self._lines_written = self._start, False
    self._log_every, self._summary = log_every_seconds, summary
    self._ticker = None
    if not shown:
      return
    if on_terminal():
      import tqdm  # pylint: disable=g-import-not-at-top
      self._bar = tqdm.tqdm(total=total, desc=what, unit=f" {unit}" if unit else "it",
                            dynamic_ncols=True, leave=True, file=sys.stderr)
    self._ticker = threading.Thread(target=self._tick, name=f"progress:{what}", daemon=True)
    self._ticker.start()

  def __enter__(self) -> "Progress":
    return self

  def __exit__(self, *exc) -> None:
    self.close(finished=exc[0] is None)

  def advance(self, n: int = 0, **counts: float) -> None:
    """n more units done; counts added to the counters."""
    with self._lock:
      self.done += n
      for name, value in counts.items():
        self.counts[name] += value
    if self._bar is not None:
      self._bar.update(n)

  def rates(self) -> dict[str, float]:
    elapsed = max(time.monotonic() - self._start, 1e-9)
    return {name: value / elapsed for name, value in self.counts.items()}

  def eta_seconds(self) -> float | None:
    """From the units done so far; None before the first, or with no total."""
    if not self.total or not self.done:
      return None
    elapsed = time.monotonic() - self._start
    return elapsed / self.done * max(self.total - self.done, 0)

  def describe(self) -> str:
    """One line: units done, counters with rates, elapsed time and ETA."""
    elapsed = time.monotonic() - self._start
    if self.total:
      parts = [f"{self.done:,}/{self.total:,} {self.unit} ({self.done / self.total:.0%})"]
    else:
      parts = [f"{self.done:,} {self.unit}".rstrip()]
    parts += [f"{_amount(value)} {name} ({_amount(rate)} {name}/s)"
              for (name, value), rate in zip(self.counts.items(), self.rates().values())]
    parts.append(f"elapsed {_duration(elapsed)}")
    eta = self.eta_seconds()
    if eta is not None and self.done < self.total:
      parts.append(f"ETA {_duration(eta)}")
    return f"{self.what}: " + ", ".join(parts)

  def close(self, finished: bool = True) -> None:
    if self._closed.is_set():
      return
    self._closed.set()
    if self._ticker is not None:
      self._ticker.join()
    if self._bar is not None:
      self._show_counters()
      self._bar.close()
    elif self._ticker is not None and finished and (self._summary or self._lines_written):
      logging.info("%s", self.describe())

  def _tick(self) -> None:
    while not self._closed.wait(_REDRAW_EVERY_SECONDS):
      if self._bar is not None:
        self._show_counters()
        self._bar.refresh()
      elif time.monotonic() - self._last_line >= self._log_every:
        self._last_line, self._lines_written = time.monotonic(), True
        logging.info("%s", self.describe())

  def _show_counters(self) -> None:
    if self.counts:
      self._bar.set_postfix_str(", ".join(
          f"{_amount(rate)} {name}/s" for name, rate in self.rates().items()), refresh=False)


def _amount(value: float) -> str:
  return f"{value:,.0f}" if value >= 100 else f"{value:,.3g}"


def iterate(items: Iterable[T], what: str, total: int | None = None, unit: str = "",
            shown: bool = True) -> Iterator[T]:
  """Yields items, advancing a Progress by one for each."""
  with Progress(what, total, unit, shown=shown) as bar:
    for item in items:
      yield item
      bar.advance(1)


@contextlib.contextmanager
def waiting(what: str, shown: bool = True) -> Iterator[Progress]:
  """A silent wait (a compile): its elapsed time on the bar, or a line now and then."""
  with Progress(what, shown=shown) as bar:
    yield bar
