"""`python -m levanter_flax.main`, paused once its step 2 checkpoint is written, for lock tests.

Each process then touches $PAUSE_DIR/paused_<process index> and waits for
$PAUSE_DIR/go. A gs:// lock is renewed every 0.5 s.
"""
import os
import pathlib
import runpy
import time

import jax

from levanter_flax.checkpoint import store
from levanter_flax.core import locks

locks._ObjectLease.RENEW_SECONDS = 0.5  # pylint: disable=protected-access
_save = store.Checkpointer.save


def _save_then_pause(self, step, *args, **kwargs):
  _save(self, step, *args, **kwargs)
  if step == 2:
    self._finish_writing()  # pylint: disable=protected-access
    pause = pathlib.Path(os.environ["PAUSE_DIR"])
    (pause / f"paused_{jax.process_index()}").touch()
    while not (pause / "go").exists():
      time.sleep(0.05)


store.Checkpointer.save = _save_then_pause
runpy.run_module("levanter_flax.main", run_name="__main__", alter_sys=True)
