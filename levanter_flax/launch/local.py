"""Runs an experiment's work units as local subprocesses, a few at a time.

Each unit trains in <root>/<experiment>/<unit>/ (local or gs://) with its
output in log.txt there. A unit is done when the config.json there is the unit's config and its
run wrote the checkpoint of its last step, so a rerun skips done units and
resumes the others from their checkpoints. A workdir whose run had another
config is refused, unless only trainer.num_train_steps grew: the run extends.
An interrupted launch (Ctrl-C, SIGTERM, SIGHUP) passes SIGTERM on: units
checkpoint and stop cleanly, and the launch waits for them. A launch that dies
(kill -9, the OOM killer) leaves no unit running outside --max_parallel: the
kernel sends each its SIGTERM then (Linux).
"""
import dataclasses
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

from etils import epath

from levanter_flax import config
from levanter_flax.core import lifetime, paths
from levanter_flax.checkpoint import preemption
from levanter_flax.core.errors import UserError
from levanter_flax.launch.experiment import Experiment, WorkUnit

@dataclasses.dataclass
class Outcome:
  unit: WorkUnit
  workdir: epath.Path
  state: str = "pending"  # pending, running, finished, skipped, refused, failed, interrupted.
  returncode: Optional[int] = None
  seconds: float = 0.0


def is_done(workdir: epath.Path, wanted: dict[str, Any]) -> bool:
  """Whether `workdir` holds the finished run of the config `wanted` (WorkUnit.resolved).

  False for a new workdir, an unfinished run of `wanted`, and a run that only
  needs more steps. A run of any other config, or an unreadable config.json,
  raises a UserError: those checkpoints are not this config's, and resuming
  them would mix the two.
  """
  try:
    saved = config.read_saved(workdir)
  except (OSError, ValueError) as e:
    # Its checkpoints cannot be matched to a config (and the trainer fails on it as it resumes).
    raise UserError(f"cannot read {workdir / 'config.json'}: {e}; remove it to continue the run "
                    f"there unchecked, or use a new --root or experiment name") from None
  if saved is None:  # Nothing trained yet, or no restore succeeded; the trainer checks the rest.
    return False
  wanted = config.keep_chosen(wanted, saved)  # As the trainer saves it: what its start chose.
  steps = "trainer.num_train_steps"
  changed = config.changes(saved, wanted)
  if not changed:
    return (workdir / "checkpoints" / str(wanted[steps])).is_dir()
  if (config.changes(saved, wanted, [steps]) == changed and isinstance(saved.get(steps), int)
      and saved[steps] < wanted[steps]):
    return False  # The trainer resumes and goes on to the new last step.
  raise UserError(f"{workdir} holds a run of another config ({', '.join(changed)}); only a "
                  f"larger {steps} can continue it: use a new --root or experiment name for "
                  f"this one")


def run(experiment: Experiment, units: list[WorkUnit], root: epath.Path, max_parallel: int,
        poll_seconds: float = 0.5) -> list[Outcome]:
  """Runs the units not done yet, at most `max_parallel` at once; returns every unit's outcome."""
  outcomes = [Outcome(u, root / experiment.name / u.name) for u in units]
  for outcome in outcomes:
    try:
      done = is_done(outcome.workdir, outcome.unit.resolved)
    except UserError as e:  # This unit only: the others still run.
      outcome.state = "refused"
      _say(outcome, f"refused: {e}")
      continue
    if done:
      outcome.state = "skipped"
      _say(outcome, "done in an earlier launch")
  pending = [o for o in outcomes if o.state == "pending"]
  running: dict[subprocess.Popen, Outcome] = {}
  interrupted, signalled = [], set()
  previous = {s: signal.signal(s, lambda signum, frame: interrupted.append(signum))
              for s in preemption.STOP_SIGNALS}
  try:
    while (pending and not interrupted) or running:
      while pending and len(running) < max_parallel and not interrupted:
        outcome = pending.pop(0)
        running[_start(experiment, outcome)] = outcome
      if interrupted:
        for process in running.keys() - signalled:  # Once: the trainer checkpoints and exits.
          process.send_signal(signal.SIGTERM)
          signalled.add(process)
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
  with open(_log(outcome), "a", encoding="utf-8") as log:
    log.write(f"$ {' '.join(command)}\n")
    log.flush()
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True,  # Ctrl-C reaches the launcher alone.
                               # Started by this, the main thread, which lives as long as we do.
                               preexec_fn=lifetime.ends_with_this_process(signal.SIGTERM))
  outcome.state, outcome.seconds = "running", time.monotonic()
  _say(outcome, "started")
  return process


def _finish(outcome: Outcome, returncode: int, interrupted: bool) -> None:
  outcome.seconds = time.monotonic() - outcome.seconds
  outcome.returncode = returncode
  if returncode == 0 and _finished(outcome):
    outcome.state = "finished"
  elif returncode == 0 or interrupted:
    outcome.state = "interrupted"
  else:
    outcome.state = "failed"
  if paths.is_remote(outcome.workdir):  # Kept with the run, as for a local root.
    epath.Path(_log(outcome)).copy(outcome.workdir / "log.txt", overwrite=True)
  detail = f"exit {returncode}" + (f", see {_log(outcome)}" if returncode else "")
  _say(outcome, f"{outcome.state} ({detail}) after {outcome.seconds:.0f} s")


def _log(outcome: Outcome) -> str:
  """<workdir>/log.txt; for a gs:// workdir, a local file (a process writes it as it goes),
  copied there when the unit ends."""
  if not paths.is_remote(outcome.workdir):
    return str(outcome.workdir / "log.txt")
  local = pathlib.Path(tempfile.gettempdir(), "levanter_flax-launch",
                       *paths.split_gcs(outcome.workdir))
  local.mkdir(parents=True, exist_ok=True)
  return str(local / "log.txt")


def _finished(outcome: Outcome) -> bool:
  try:
    return is_done(outcome.workdir, outcome.unit.resolved)
  except UserError as e:  # The run saved a config other than the unit's: not this unit's result.
    _say(outcome, str(e))
    return False


def _say(outcome: Outcome, what: str) -> None:
  print(f"[{outcome.unit.name}] {what}", flush=True)


def status_table(outcomes: list[Outcome]) -> str:
  rows = [("unit", "state", "exit", "seconds", "workdir")]
  rows += [(o.unit.name, o.state, "-" if o.returncode is None else str(o.returncode),
            f"{o.seconds:.0f}" if o.returncode is not None else "-", str(o.workdir))
           for o in outcomes]
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
