"""`python -m levanter_flax.main` with two test hooks, for multi-process agreement tests.

Process 1 sleeps $SKEW_SECONDS before each batch, so the processes' clocks and
host loops drift apart as on a real pod; and each process appends every
checkpoint it writes ("<step> <why>") to $SAVES_DIR/process_<index>.txt.
"""
import os
import pathlib
import runpy
import time

import jax

from levanter_flax.checkpoint import store
from levanter_flax.data import loader

_next_batch, _save = loader.TrainBatches.__next__, store.Checkpointer.save


def _skewed_next(self):
  if jax.process_index() == 1:
    time.sleep(float(os.environ["SKEW_SECONDS"]))
  return _next_batch(self)


def _listed_save(self, step, state, data_position, due="step"):
  with open(pathlib.Path(os.environ["SAVES_DIR"]) / f"process_{jax.process_index()}.txt", "a") as f:
    f.write(f"{step} {due}\n")
  return _save(self, step, state, data_position, due)


loader.TrainBatches.__next__, store.Checkpointer.save = _skewed_next, _listed_save
runpy.run_module("levanter_flax.main", run_name="__main__", alter_sys=True)
