"""SIGTERM and SIGINT end a run cleanly: finish the step, write a checkpoint, exit 0.

Schedulers and cloud/TPU preemption send SIGTERM, Ctrl-C sends SIGINT. The
handler only records the signal; the training loop asks `requested()` after
each step. Later signals are ignored until the process exits: the last
checkpoint is written whatever else arrives (SIGKILL still ends it at once). With several processes they agree through an all-gather, so every
process stops after the same step and writes the same checkpoint.
"""
import signal

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignal:
  """A context manager that turns SIGTERM/SIGINT into a request to stop after this step."""

  def __init__(self):
    self.received = None
    self._previous = {}

  def __enter__(self) -> "StopSignal":
    for signum in SIGNALS:
      self._previous[signum] = signal.signal(signum, self._record)
    return self

  def __exit__(self, *exc) -> None:
    # Once a stop was requested, the process is on its way out: a repeated signal (an
    # impatient scheduler, a second Ctrl-C) must not turn that clean exit into a kill.
    for signum, handler in self._previous.items():
      signal.signal(signum, signal.SIG_IGN if self.received is not None else handler)

  def _record(self, signum, frame) -> None:
    del frame
    if self.received is None:
      logging.warning("Received %s: stopping after this step, with a checkpoint",
                      signal.Signals(signum).name)
    self.received = signum

  def requested(self) -> bool:
    """Whether any process got a signal; every process gets the same answer."""
    local = self.received is not None
    if jax.process_count() == 1:
      return local
    return bool(np.any(multihost_utils.process_allgather(np.array(local))))
