"""Runs an experiment's work units as local subprocesses, a few at a time.

Each unit trains in <root>/<experiment>/<unit>/ with its output in log.txt
there. A unit is done when its run wrote the checkpoint of its last step, so
a rerun skips done units and resumes the others from their checkpoints. An
interrupted launch (Ctrl-C, SIGTERM) passes SIGTERM on: units checkpoint and
stop cleanly.
"""
import dataclasses
import json
import pathlib
import signal
import subprocess
import sys
import time
from typing import Optional

from levanter_flax.launch.experiment import Experiment, WorkUnit


@dataclasses.dataclass
class Outcome:
  unit: WorkUnit
  workdir: pathlib.Path
  state: str = "pending"  # pending, running, finished, skipped, failed, interrupted.
  returncode: Optional[int] = None
  seconds: float = 0.0


def is_done(workdir: pathlib.Path) -> bool:
  """Whether the run in `workdir` checkpointed its last step (trainer.num_train_steps)."""
  try:
    last_step = json.loads((workdir / "config.json").read_text())["trainer.num_train_steps"]
  except (OSError, ValueError, KeyError):
    return False
  return (workdir / "checkpoints" / str(last_step)).is_dir()


def run(experiment: Experiment, units: list[WorkUnit], root: pathlib.Path, max_parallel: int,
        poll_seconds: float = 0.5) -> list[Outcome]:
  """Runs the units not done yet, at most `max_parallel` at once; returns every unit's outcome."""
  outcomes = [Outcome(u, root / experiment.name / u.name) for u in units]
  for outcome in outcomes:
    if is_done(outcome.workdir):
      outcome.state = "skipped"
      _say(outcome, "done in an earlier launch")
  pending = [o for o in outcomes if o.state == "pending"]
  running: dict[subprocess.Popen, Outcome] = {}
  interrupted = []
  previous = {s: signal.signal(s, lambda signum, frame: interrupted.append(signum))
              for s in (signal.SIGINT, signal.SIGTERM)}
  try:
    while (pending and not interrupted) or running:
      while pending and len(running) < max_parallel and not interrupted:
        outcome = pending.pop(0)
        running[_start(experiment, outcome)] = outcome
      if interrupted:
        for process in running:
          process.send_signal(signal.SIGTERM)  # The trainer checkpoints and exits.
      time.sleep(poll_seconds)
      for process in [p for p in running if p.poll() is not None]:
        _finish(running.pop(process), process.returncode, bool(interrupted))
  finally:
    for signum, handler in previous.items():
      signal.signal(signum, handler)
  return outcomes


def _start(experiment: Experiment, outcome: Outcome) -> subprocess.Popen:
  outcome.workdir.mkdir(parents=True, exist_ok=True)
  command = [sys.executable, "-m", "levanter_flax.main", f"--workdir={outcome.workdir}",
             *outcome.unit.flags(experiment.config)]
  with open(outcome.workdir / "log.txt", "a", encoding="utf-8") as log:
    log.write(f"$ {' '.join(command)}\n")
    log.flush()
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)  # Ctrl-C reaches the launcher alone.
  outcome.state, outcome.seconds = "running", time.monotonic()
  _say(outcome, "started")
  return process


def _finish(outcome: Outcome, returncode: int, interrupted: bool) -> None:
  outcome.seconds = time.monotonic() - outcome.seconds
  outcome.returncode = returncode
  if returncode == 0 and is_done(outcome.workdir):
    outcome.state = "finished"
  elif returncode == 0 or interrupted:
    outcome.state = "interrupted"
  else:
    outcome.state = "failed"
  detail = f"exit {returncode}" + (f", see {outcome.workdir / 'log.txt'}" if returncode else "")
  _say(outcome, f"{outcome.state} ({detail}) after {outcome.seconds:.0f} s")


def _say(outcome: Outcome, what: str) -> None:
  print(f"[{outcome.unit.name}] {what}", flush=True)


def status_table(outcomes: list[Outcome]) -> str:
  rows = [("unit", "state", "exit", "seconds", "workdir")]
  rows += [(o.unit.name, o.state, "-" if o.returncode is None else str(o.returncode),
            f"{o.seconds:.0f}" if o.returncode is not None else "-", str(o.workdir))
           for o in outcomes]
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
