"""killed_after_checkpoint_main.py (`python -m levanter_flax.main`, killed after the checkpoint of
$KILL_AFTER_CHECKPOINT), whose train batches at the stream positions $SPIKE_WINDOWS
(comma-separated) are all one token the corpus never holds: a step on one is a loss spike."""
import os
import pathlib
import runpy

import numpy as np

from levanter_flax.data import loader

_tagged = loader.TrainBatches._tagged  # pylint: disable=protected-access
SPIKES = {int(w) for w in os.environ.get("SPIKE_WINDOWS", "").split(",") if w}


def _spiked(self):
  for batch, position in _tagged(self):
    if position.windows in SPIKES:
      batch = dict(batch, tokens=np.ones_like(batch["tokens"]))  # Byte 1: not in Python source.
    yield batch, position


loader.TrainBatches._tagged = _spiked  # pylint: disable=protected-access
runpy.run_path(str(pathlib.Path(__file__).with_name("killed_after_checkpoint_main.py")),
               run_name="__main__")
