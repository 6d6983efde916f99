"""`python -m levanter_flax.main` that kills itself (SIGKILL) once the checkpoint of step
$KILL_AFTER_CHECKPOINT is written: between a step's checkpoint and its eval, as a preemption
without notice can."""
import os
import runpy
import signal

from levanter_flax.checkpoint import store

_save = store.Checkpointer.save


def _save_then_die(self, step, *args, **kwargs):
  _save(self, step, *args, **kwargs)
  if str(step) == os.environ.get("KILL_AFTER_CHECKPOINT"):
    self._finish_writing()  # pylint: disable=protected-access  # The checkpoint is whole.
    os.kill(os.getpid(), signal.SIGKILL)


store.Checkpointer.save = _save_then_die
runpy.run_module("levanter_flax.main", run_name="__main__", alter_sys=True)
