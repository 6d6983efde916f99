"""SIGTERM, SIGINT and SIGHUP end a run cleanly: finish the step, write a checkpoint, exit 0.

Schedulers and cloud/TPU preemption send SIGTERM, Ctrl-C sends SIGINT, a
closed terminal (and some schedulers) SIGHUP, whose default would kill the run
without its checkpoint.

One process: a handler records the signal, and the loop asks after each step.

Several processes: they must stop after the same step, as the last save is
collective, but asking the others every step would be an all-gather that
waits for the step to finish. jax.distributed's preemption service does it
without one: it owns SIGTERM, tells the coordinator, which picks a step that
no process has passed yet, and `multihost_utils.reached_preemption_sync_point`
is then a local read on every process. A SIGINT or SIGHUP is handed on to
that service as a SIGTERM, so Ctrl-C on any process also stops all of them
together.

Once a stop is on its way, later signals are ignored until the process
exits: the last checkpoint is written whatever else arrives (SIGKILL still
ends it at once).
"""
import signal

import jax
from absl import logging
from jax.experimental import multihost_utils

from levanter_flax.core.errors import UserError

# What asks a run (or a launcher, launch/local.py) to stop cleanly.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class StopSignal:
  """A context manager that turns STOP_SIGNALS into a request to stop after a step."""

  def __init__(self):
    self.received = None
    self._previous = {}
    self._shared = False  # Whether jax's preemption service decides (several processes).
    self._sync_point_reached = False

  def __enter__(self) -> "StopSignal":
    self._shared = jax.process_count() > 1
    if self._shared and not jax.config.jax_enable_preemption_service:
      raise UserError("a run of several processes stops on SIGTERM through jax's preemption "
                      "service, which is switched off (jax_enable_preemption_service=False)")
    # With several processes, SIGTERM stays with jax's handler; taking it would cut jax out.
    for signum in (s for s in STOP_SIGNALS if not (self._shared and s == signal.SIGTERM)):
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
      logging.warning("Received %s: stopping after a step that every process reaches, with a "
                      "checkpoint", signal.Signals(signum).name)
      if self._shared:
        signal.raise_signal(signal.SIGTERM)  # To jax's handler, which tells the others.
    self.received = signum

  def requested(self, step: int) -> bool:
    """Whether to stop after `step`; every process gets the same answer for the same step.

    Call it once after every step, with increasing steps (but those a rollback trains again).
    """
    if not self._shared:
      return self.received is not None
    # Once reached, every later call stops too: a spike rollback trains steps before it again.
    if self._sync_point_reached or multihost_utils.reached_preemption_sync_point(step):
      self._sync_point_reached = True
      self.received = self.received or signal.SIGTERM
    return self._sync_point_reached
