"""killed_after_checkpoint_main.py (`python -m levanter_flax.main`, killed after the checkpoint of
$KILL_AFTER_CHECKPOINT), whose train batches at the stream positions $SPIKE_WINDOWS
(comma-separated; "N-": N and every later one, a lasting change of level) are all one token the
corpus never holds: a step on one is a loss spike. $TERM_AT=rollback sends the run SIGTERM at
the step that rolls it back, =restart between the rollback and the next attempt."""
import os
import pathlib
import runpy
import signal

import numpy as np

from levanter_flax.optim import spikes
from levanter_flax.data import loader

_tagged = loader.TrainBatches._tagged  # pylint: disable=protected-access
_WINDOWS = [w for w in os.environ.get("SPIKE_WINDOWS", "").split(",") if w]
SPIKES = {int(w) for w in _WINDOWS if not w.endswith("-")}
SPIKES_FROM = min((int(w[:-1]) for w in _WINDOWS if w.endswith("-")), default=None)


def _is_spike(windows: int) -> bool:
  return windows in SPIKES or (SPIKES_FROM is not None and windows >= SPIKES_FROM)


def _spiked(self):
  for batch, position in _tagged(self):
    if _is_spike(position.windows):
      batch = dict(batch, tokens=np.ones_like(batch["tokens"]))  # Byte 1: not in Python source.
    yield batch, position


def _terminate(signum=signal.SIGTERM):
  os.kill(os.getpid(), signum)


def _terminated_on_rollback(flush):
  def flush_then_terminate(*args, **kwargs):
    try:
      return flush(*args, **kwargs)
    except spikes.RollBack:
      _terminate()  # At the step that rolls back, before the run unwinds.
      raise
  return flush_then_terminate


def _terminated_after(roll_back):
  def roll_back_then_terminate(*args, **kwargs):
    roll_back(*args, **kwargs)
    _terminate()  # Between the attempts: no StopSignal of an attempt is open.
  return roll_back_then_terminate


loader.TrainBatches._tagged = _spiked  # pylint: disable=protected-access
if os.environ.get("TERM_AT") == "rollback":
  spikes.SpikeWatch.flush = _terminated_on_rollback(spikes.SpikeWatch.flush)
elif os.environ.get("TERM_AT") == "restart":
  spikes.roll_back = _terminated_after(spikes.roll_back)
runpy.run_path(str(pathlib.Path(__file__).with_name("killed_after_checkpoint_main.py")),
               run_name="__main__")
