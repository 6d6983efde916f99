"""The Python API: train a run and load one back, as the commands do.

    import levanter_flax as lf
    result = lf.train("gpt2:nano", "runs/nano", callbacks=[lf.Callback(100, print_loss)])
    loaded = lf.load("runs/nano")  # loaded.params, loaded.model, loaded.tokenizer

Bad input raises levanter_flax.core.errors.UserError, whose message is the one line the command
line would print.
"""
import dataclasses
import functools
import os
from typing import Any, Sequence

import flax.linen as nn
import ml_collections
from etils import epath

from levanter_flax.parallel import backend
from levanter_flax.generate import trained
from levanter_flax import config as config_lib, models
from levanter_flax.core import paths
from levanter_flax.training.callbacks import Callback
from levanter_flax.core.errors import UserError
from levanter_flax.config.settings import RunConfig
from levanter_flax.training.loop import TrainResult, run_training

__all__ = ["train", "load", "load_config", "Callback", "TrainResult", "Loaded"]

ConfigLike = ml_collections.ConfigDict | RunConfig | str | os.PathLike


def load_config(name: str | os.PathLike) -> ml_collections.ConfigDict:
  """The ConfigDict that --config=NAME reads, to change before lf.train: a shipped config's name
  (gpt2_nano, gpt2:nano) or a config file's path, with an optional :VARIANT."""
  return config_lib.load_config_file(os.fspath(name))


def train(config: ConfigLike, workdir: str | os.PathLike,
          callbacks: Sequence[Callback] = ()) -> TrainResult:
  """Trains `config` in `workdir` (resuming from its checkpoints, as the command line does) and
  returns the final state and the last metrics (result.state, result.params, result.metrics).

  `config`: a ConfigDict (load_config's, changed), a config name or file (as load_config
  takes), or a RunConfig. jax starts as the command line starts it (the CPU split,
  jax.distributed), unless it already runs in this process: a second lf.train may not ask
  for another trainer.cpu_devices.
  """
  run = _run_config(config)
  backend.start(run.trainer)
  return run_training(run, workdir, callbacks)  # It takes the workdir as the user gave it.


def _run_config(config: ConfigLike) -> RunConfig:
  if isinstance(config, RunConfig):
    return config
  if isinstance(config, (str, os.PathLike)):
    config = load_config(config)
  if not isinstance(config, ml_collections.ConfigDict):
    raise UserError(f"lf.train's config must be a ConfigDict, a config's name or path, or a "
                    f"RunConfig; got {type(config).__name__}")
  return config_lib.to_run_config(config)


@dataclasses.dataclass(frozen=True)
class Loaded:
  """A run's newest readable checkpoint, for sampling or export:
  model.apply({"params": params}, tokens) gives the logits."""
  params: Any  # Host numpy arrays; with LoRA, the adapters merged into the base.
  model: nn.Module
  model_config: Any  # The model family's config dataclass.
  config: dict[str, Any]  # The run's config.json: {"trainer.batch_size": 16, ...}.
  workdir: epath.Path

  @functools.cached_property
  def tokenizer(self):
    """The tokenizer the run trained with (config.json's data.tokenizer), checked against its
    datasets' manifests as `sample` checks it: encode(text) -> ids, decode(ids) -> text."""
    return trained.run_tokenizer(self.workdir, self.config)


def load(workdir: str | os.PathLike) -> Loaded:
  """The params and model of `workdir`'s newest readable checkpoint, as `sample` and
  `export_hf` read them (generate.trained.run_params), with the run's config and tokenizer."""
  workdir = paths.resolve(workdir, "workdir")
  model_config, params, saved = trained.run_params(workdir)
  return Loaded(params=params, model=models.build(model_config), model_config=model_config,
                config=saved, workdir=workdir)
