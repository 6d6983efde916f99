"""Progress of long work: a bar on a terminal, periodic lines in a log file."""
import io
import json
import pathlib
import sys
import time

import pytest

from levanter_flax.core import progress
import forkserver
from conftest import random_documents

REPO = pathlib.Path(__file__).resolve().parents[1]


class _Clock:
  def __init__(self):
    self.now = 1000.0

  def __call__(self) -> float:
    return self.now


@pytest.fixture
def clock(monkeypatch):
  fake = _Clock()
  monkeypatch.setattr(progress.time, "monotonic", fake)
  return fake


def test_line_counts_rates_and_eta(clock):
  bar = progress.Progress("prepare out", total=8, unit="shards", counters=("documents", "MB"),
                          shown=False)
  clock.now += 20
  bar.advance(2, documents=4000, MB=10)
  line = bar.describe()
  assert line == ("prepare out: 2/8 shards (25%), 4,000 documents (200 documents/s), "
                  "10 MB (0.5 MB/s), elapsed 0:00:20, ETA 0:01:00")
  bar.advance(6)
  assert "ETA" not in bar.describe() and "8/8 shards (100%)" in bar.describe()
  bar.close()


def test_unknown_total_has_no_eta(clock):
  bar = progress.Progress("compile", shown=False)
  clock.now += 65
  assert bar.eta_seconds() is None
  assert bar.describe() == "compile: 0, elapsed 0:01:05"
  bar.close()


def _log_lines(monkeypatch) -> list[str]:
  lines = []
  monkeypatch.setattr(progress.logging, "info", lambda fmt, *args: lines.append(fmt % args))
  return lines


def test_a_log_file_gets_periodic_lines_without_carriage_returns(monkeypatch, capsys):
  monkeypatch.setattr(progress, "on_terminal", lambda: False)
  monkeypatch.setattr(progress, "_REDRAW_EVERY_SECONDS", 0.01)
  lines = _log_lines(monkeypatch)
  with progress.Progress("eval", total=3, unit="batches", log_every_seconds=0.02) as bar:
    for _ in range(3):
      time.sleep(0.1)
      bar.advance(1)
  assert len(lines) >= 3, lines  # Several while it ran, and one at its end.
  assert lines[-1].startswith("eval: 3/3 batches (100%)")
  assert "\r" not in capsys.readouterr().err


def test_short_work_in_a_log_file_writes_nothing_unless_summarized(monkeypatch):
  monkeypatch.setattr(progress, "on_terminal", lambda: False)
  lines = _log_lines(monkeypatch)
  with progress.Progress("eval", total=1) as bar:
    bar.advance(1)
  assert not lines
  with progress.Progress("prepare", total=1, summary=True) as bar:
    bar.advance(1)
  assert lines == [lines[0]] and lines[0].startswith("prepare: 1/1")


def test_a_terminal_gets_a_bar(monkeypatch):
  monkeypatch.setattr(progress, "on_terminal", lambda: True)
  err = io.StringIO()
  monkeypatch.setattr(progress.sys, "stderr", err)
  lines = _log_lines(monkeypatch)
  with progress.Progress("export", total=2, unit="files", counters=("MB",)) as bar:
    bar.advance(1, MB=3)
    bar.advance(1, MB=3)
  assert "2/2" in err.getvalue() and "MB/s" in err.getvalue()
  assert not lines


def test_hidden_progress_shows_nothing(monkeypatch):
  monkeypatch.setattr(progress, "on_terminal", lambda: True)
  err = io.StringIO()
  monkeypatch.setattr(progress.sys, "stderr", err)
  lines = _log_lines(monkeypatch)
  assert list(progress.iterate(range(3), "eval", total=3, shown=False)) == [0, 1, 2]
  assert not err.getvalue() and not lines


@pytest.mark.slow
def test_prepare_logs_documents_bytes_and_shards(tmp_path):
  """Run as a user runs it, into a log (stderr not a terminal), with two worker processes:
  their documents and bytes reach the closing line."""
  inputs = tmp_path / "input"
  inputs.mkdir()
  texts = random_documents(40)
  for i, text in enumerate(texts):
    (inputs / f"{i:03d}.txt").write_text(text, encoding="utf-8")
  out = tmp_path / "data"
  done = forkserver.run([sys.executable, "-m", "levanter_flax.commands.prepare", "--source=text",
                         f"--input={inputs}/*.txt", f"--output_dir={out}", "--num_shards=4",
                         "--num_workers=2", "--validation_fraction=0.2"], cwd=REPO, capture_output=True, text=True)
  assert done.returncode == 0, done.stderr
  assert "\r" not in done.stderr
  closing = [l for l in done.stderr.splitlines() if f"prepare {out}: 4/4 shards" in l]
  assert len(closing) == 1, done.stderr
  manifest = json.loads((out / "manifest.json").read_text())
  documents = sum(s["num_documents"] for split in manifest["splits"].values() for s in split)
  assert f" {documents} documents (" in closing[0]
  megabytes = sum(len(t.encode()) for t in texts) / 1e6
  assert f" {megabytes:,.3g} MB (" in closing[0]
