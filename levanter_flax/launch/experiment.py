"""An experiment: a config file, work units of overrides, and the checks before anything runs."""
import dataclasses
import itertools
import pathlib
import re
from typing import Any, Mapping, Sequence

import ml_collections
from absl import flags

from levanter_flax.config import (call_from_file, define_config_flag, flat_dict, load_config_file,
                                  modern_key, run_config_of_flags)
from levanter_flax.core.errors import UserError

Overrides = Mapping[str, Any]  # Config key without the "config." prefix -> value.


def sweep(key: str, values: Sequence[Any]) -> list[dict[str, Any]]:
  """One work unit per value of one config key, as xmanager's hyper.sweep."""
  return [{key: value} for value in values]


def product(*sweeps: Sequence[Overrides]) -> list[dict[str, Any]]:
  """Every combination of the sweeps' work units (learning_rate x batch_size)."""
  return [dict(itertools.chain.from_iterable(unit.items() for unit in units))
          for units in itertools.product(*sweeps)]


def zipit(*sweeps: Sequence[Overrides]) -> list[dict[str, Any]]:
  """The sweeps' work units side by side: the i-th of each together."""
  if len({len(s) for s in sweeps}) > 1:
    raise UserError(f"zipit needs sweeps of one length; got {[len(s) for s in sweeps]}")
  return [dict(itertools.chain.from_iterable(unit.items() for unit in units))
          for units in zip(*sweeps)]


@dataclasses.dataclass(frozen=True)
class Experiment:
  name: str
  config: str  # A config file, e.g. configs/gpt2_nano.py, relative to where the launch runs.
  work_units: Sequence[Overrides]
  overrides: Overrides = dataclasses.field(default_factory=dict)  # For every work unit.


@dataclasses.dataclass(frozen=True)
class WorkUnit:
  index: int
  name: str  # Also its workdir's name: the index and the swept values.
  overrides: dict[str, Any]
  # The config its run saves as <workdir>/config.json (config.flat_dict), except that
  # trainer.batch_size may still be "auto" here: the trainer saves what that resolved to.
  resolved: dict[str, Any]

  def flags(self, config: str) -> list[str]:
    """The command-line flags of `python -m levanter_flax.main` for this unit."""
    return _flags(config, self.overrides)


def _flags(config: str, overrides: Overrides) -> list[str]:
  return [f"--config={config}", *(f"--config.{k}={_flag_value(v)}" for k, v in overrides.items())]


def _flag_value(value: Any) -> str:
  return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def load_experiment(path: pathlib.Path) -> Experiment:
  """get_experiment() of an experiment file."""
  experiment = call_from_file(path, "get_experiment", "experiment file")
  if not isinstance(experiment, Experiment):
    raise UserError(f"get_experiment() of {path} must return a levanter_flax.launch.Experiment; "
                    f"got {type(experiment).__name__}")
  if not re.fullmatch(r"[\w.-]+", experiment.name):
    raise UserError(f"experiment name {experiment.name!r} in {path} must be letters, digits, "
                    f"'_', '-' or '.': it names a directory")
  return experiment


def work_units(experiment: Experiment) -> list[WorkUnit]:
  """The units with their overrides checked against the config file: keys, then values."""
  config = load_config_file(experiment.config)
  swept_units = experiment.work_units or [{}]
  # Old key names renamed once, each warned once.
  named = {k: modern_key(k, f"config.{k}")
           for k in dict.fromkeys(k for unit in (experiment.overrides, *swept_units) for k in unit)}
  units = []
  for index, swept in enumerate(swept_units):
    overrides = {named[k]: v for k, v in {**experiment.overrides, **swept}.items()}
    where = f"work unit {index} ({_describe(swept)}) of experiment {experiment.name}"
    for key in overrides:
      if not _has_key(config, key):
        raise UserError(f"{where} overrides unknown config key config.{key}")
    resolved = _resolve(_flags(experiment.config, overrides), where)
    units.append(WorkUnit(index, _unit_name(index, swept), overrides, resolved))
  return units


def _resolve(unit_flags: list[str], where: str) -> dict[str, Any]:
  """The flat config of a unit's run, read from its flags the way levanter_flax.main reads them.

  Parsing the very flags the unit will get, with config_flags, gives each
  value the type the trainer will see ("0.001" -> float, "auto" stays a str).
  """
  argv = ["levanter_flax.main", *unit_flags]
  values = flags.FlagValues()  # Not absl's FLAGS: those hold the launcher's own flags.
  define_config_flag("The unit's config file.", flag_values=values, sys_argv=argv)
  try:
    values(argv)
    return flat_dict(run_config_of_flags(values))
  except UserError as e:
    raise UserError(f"{where}: {e}") from None
  except Exception as e:  # pylint: disable=broad-except  # config_flags' errors for a bad value.
    message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise UserError(f"{where}: {message}") from None


def _has_key(config: ml_collections.ConfigDict, key: str) -> bool:
  node = config
  for part in key.split("."):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      return False
    node = node[part]
  return True


def _describe(swept: Overrides) -> str:
  return ", ".join(f"{k}={v}" for k, v in swept.items()) or "no overrides"


def _unit_name(index: int, swept: Overrides) -> str:
  values = ",".join(f"{k.rsplit('.', 1)[-1]}={_flag_value(v)}" for k, v in swept.items())
  return re.sub(r"[^\w.,=-]", "_", f"{index:03d}" + (f"_{values}" if values else ""))[:120]
