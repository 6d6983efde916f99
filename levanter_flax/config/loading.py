"""The config edge: a ConfigDict (a configs/ file and its --config.KEY=VALUE overrides) in,
plain typed objects (settings.RunConfig) out.

Every setting is declared once, in its section's dataclass (schema.setting): default_config()
is generated from those declarations, and so are --print_config, the checks of a resume
(STATE settings), and what a run chooses at start (CHOSEN). Old key names keep working through
ALIASES, with a one-line warning naming the new key.
"""
import dataclasses
import importlib.util
import json
import pathlib
import re
import sys
import traceback
import types
import typing
from typing import Any, Collection, Optional, Sequence

import ml_collections
from absl import flags
from etils import epath
from ml_collections import config_flags

from levanter_flax.hf import snapshot
from levanter_flax import models
from levanter_flax.optim import optimizers, schedules
from levanter_flax.parallel import partitioning
from levanter_flax.core import paths, schema
from levanter_flax.config import settings
from levanter_flax.core.errors import UserError, exit_with_error
from levanter_flax.config.settings import RunConfig


def mesh(**axes: int) -> ml_collections.ConfigDict:
  """An axis-name -> size mapping that keeps the order the axes were given in."""
  return ml_collections.ConfigDict(axes, sort_keys=False)


def expert_parallel(config: ml_collections.ConfigDict, expert: int) -> None:
  """A mixture of experts' pod layout on `config`: the batch over every device, each `expert`
  devices splitting the experts (tokens sent to them by all-to-all), and ZeRO-3 over all of
  them; no tensor axis (the Performance Guide's expert parallelism)."""
  config.trainer.device_mesh = mesh(data=-1, expert=expert)
  config.sharding.activation_axis = "data,expert"
  config.sharding.tensor_axis = ""
  config.sharding.expert_axis = "expert"
  config.sharding.parameter_axis = "data,expert"
  config.sharding.optimizer_axis = "data,expert"


def _as_config(declared: schema.Declared, value: Any) -> Any:
  """A setting's value as a config file writes it: a mapping as an ordered ConfigDict, a
  setting of several types ("auto" or an int) as a FieldReference that takes either."""
  if isinstance(value, dict):
    return mesh(**value)
  if typing.get_origin(declared.field.type) in (typing.Union, types.UnionType):
    return ml_collections.FieldReference(value, field_type=object)
  return value


def _section_config(section: type, values: dict[str, Any], caller: str,
                    defaults: Any = None) -> ml_collections.ConfigDict:
  """A ConfigDict of `section`'s settings, nested sections nested: `values` where given (a
  nested section's as a dict of its own), else the declared defaults, or those of `defaults`
  (a family's own instance of the section: Qwen3-MoE's 128 experts). `caller` names what needs
  a setting that has no default."""
  config = ml_collections.ConfigDict()
  for field in dataclasses.fields(section):
    declared = schema.Declared(field.name, field, *(() if defaults is None
                                                     else (getattr(defaults, field.name),)))
    if schema.is_section(field):
      config[field.name] = _section_config(type(field.default), dict(values.pop(field.name, {})),
                                           caller, declared.default)
    elif field.name in values:
      config[field.name] = values.pop(field.name)
    elif declared.default is not dataclasses.MISSING:
      config[field.name] = _as_config(declared, declared.written)
    else:
      raise UserError(f"{caller} needs {field.name}")
  if values:
    raise UserError(f"{caller} got unknown settings: {', '.join(values)}")
  return config


def default_config() -> ml_collections.ConfigDict:
  """Every setting at its declared default: GPT-2 small (124M) on the built-in corpus.
  configs/ files start from this; --print_config lists it with each key's description."""
  config = ml_collections.ConfigDict()
  for name, section in settings.sections("gpt2").items():
    config[name] = _section_config(section, {}, "default_config()")
  return config


def model_config(architecture: str, **values) -> ml_collections.ConfigDict:
  """The model section of a family: its config dataclass's settings, defaults unless in `values`.

  A config file does config.model = model_config("qwen2", vocab_size=..., ...) and gets the
  family's partition rules with it. config.model.compute (remat, dtypes, attention, scan) is
  the same for every family; the family's module documents the rest.
  """
  if architecture not in models.FAMILIES:
    raise UserError(f"unknown model architecture {architecture!r}; known: "
                    f"{', '.join(models.FAMILIES)}")
  for key in [k for k in values if f"model.{k}" in ALIASES]:  # Now in a nested section.
    _, section, name = modern_key(f"model.{key}", f"model_config({key}=...)").split(".")
    values[section] = {**values.get(section, {}), name: values.pop(key)}
  return _section_config(models.FAMILIES[architecture].config,
                         dict(values, architecture=architecture), f"model_config({architecture!r})")


def llama_model_config() -> ml_collections.ConfigDict:
  """The model section of a Llama (TinyLlama-1.1B's shape); set the sizes after."""
  # Grouped-query attention: each key/value head serves 8 query heads; SwiGLU 5632 wide.
  return model_config("llama", vocab_size=32000, seq_len=2048, num_layers=22, num_heads=32,
                      num_kv_heads=4, hidden_dim=2048, intermediate_dim=5632)


# The configs the package ships; a checkout's configs/ is a link to it.
SHIPPED_CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


def shipped_names(pattern: str = "*.py") -> list[str]:
  """The shipped configs `pattern` matches, by the names they are found by: gpt2, gpt2_nano, ...
  ("*/*.py": the presets, optim/sophia_h_large)."""
  return sorted(p.relative_to(SHIPPED_CONFIGS).with_suffix("").as_posix()
                for p in SHIPPED_CONFIGS.glob(pattern))


def find_config_file(name: str | pathlib.Path, what: str,
                     listed: str = "*.py") -> pathlib.Path:
  """The config file `name` names: a file by its path, else a shipped config by its name.

  A name is a file's path under SHIPPED_CONFIGS, with or without .py ("gpt2_nano",
  "optim/sophia_h_large"); a leading configs/ is the checkout's link to it, so a checkout's
  paths (configs/gpt2.py) work from any directory, and from an installed package. A file
  that exists wins over a shipped config of the same name. `what` names the file in errors,
  which list the shipped configs `listed` matches. A path that starts at the working directory
  (./gpt2.py) or above it names only a local file.
  """
  path = pathlib.Path(name)
  if path.is_file():
    return path
  if str(name).startswith(("./", "../", ".\\", "..\\")):
    raise UserError(f"{what} {name} does not exist (a path from the working directory, "
                    f"{pathlib.Path.cwd()}, names a local file, not a shipped config)")
  shipped = _shipped_config(path)
  if shipped is None:
    raise UserError(f"{what} {name} does not exist, and is no shipped config's name; shipped: "
                    f"{', '.join(shipped_names(listed))}")
  return shipped


def _shipped_config(path: pathlib.Path) -> Optional[pathlib.Path]:
  parts = path.parts[1:] if path.parts[:1] == ("configs",) else path.parts
  if path.is_absolute() or not parts or ".." in parts:
    return None
  file = SHIPPED_CONFIGS.joinpath(*parts)
  file = file if file.suffix == ".py" else file.with_name(file.name + ".py")
  return file if file.is_file() else None


def load_preset(name: str | pathlib.Path) -> ml_collections.ConfigDict:
  """get_config() of a config fragment: a file, or a shipped one by name (optim/sophia_h_large;
  find_config_file), wherever the command runs.

  A config file merges it into a section: config.optimizer.update(load_preset(...)).
  """
  return call_from_file(find_config_file(name, "config preset", listed="*/*.py"), "get_config",
                        "config preset")


def load_config_file(argument: str) -> ml_collections.ConfigDict:
  """What --config=FILE[:ARG] names: get_config([ARG]) of FILE, as config_flags reads it. FILE
  is a path, or a shipped config's name (gpt2_nano, gpt2:nano; find_config_file)."""
  name, *arg = argument.split(":", 1)
  path = find_config_file(name, "config file")
  config = call_from_file(path, "get_config", "config file", *arg)
  if not isinstance(config, ml_collections.ConfigDict):
    raise UserError(f"get_config() of config file {path} returned a {type(config).__name__}, not "
                    f"an ml_collections.ConfigDict (did it forget to return the config?)")
  _move_renamed(config)
  return config


def _move_renamed(config: ml_collections.ConfigDict) -> None:
  """Moves each old key a config file set to its new place (ALIASES), warned, before the
  command line's overrides apply to the new one. A file that set both names to different
  values is refused: which one it meant is unknown."""
  defaults = default_config()
  for old in ALIASES:
    *parents, name = old.split(".")
    section = _section_at(config, parents)
    if section is None or name not in section:
      continue
    value = section[name]
    del section[name]
    new = modern_key(old, f"config.{old}")
    *parents, name = new.split(".")
    target = _section_at(config, parents, create=True)
    if name in target and target[name] not in (value, _section_at(defaults, parents)[name]):
      raise UserError(f"config.{old} ({value!r}) is the old name of config.{new}, which is set "
                      f"to {target[name]!r}: set config.{new} only")
    target[name] = value


def _section_at(config: ml_collections.ConfigDict, path: list[str], create: bool = False):
  """The section of `config` at `path`; None if there is none, unless `create`."""
  for name in path:
    if create and name not in config:
      config[name] = ml_collections.ConfigDict()
    config = config.get(name) if isinstance(config, ml_collections.ConfigDict) else None
  return config if isinstance(config, ml_collections.ConfigDict) else None


def define_config_flag(help_string: str, flag_values: flags.FlagValues = flags.FLAGS,
                       sys_argv: Optional[list[str]] = None) -> flags.FlagHolder:
  """config_flags' --config (a file, and --config.KEY=VALUE overrides), its file read by
  load_config_file."""
  holder = config_flags.DEFINE_config_file("config", None, help_string, flag_values,
                                           lock_config=True, sys_argv=sys_argv)
  flag_values["config"].parser = _ConfigFileParser(sys_argv)
  return holder


# The meshes a --config.<mesh>.stage=N override may add the pipeline's axis to.
_MESHES = ("trainer.device_mesh", "trainer.dcn_mesh")


def _add_stage_axis(config: ml_collections.ConfigDict, argv: list[str]) -> None:
  """Adds the pipeline's `stage` axis to each mesh of `config` that lacks it and an override
  sets, of size 1 until the override sets it, before its own axes: the outermost. Only that
  axis: a mistyped one stays an unknown key."""
  for mesh_key in _MESHES:
    section = _section_at(config, mesh_key.split("."))
    flag = f"--config.{mesh_key}.{partitioning.STAGE_AXIS}="
    if section is not None and partitioning.STAGE_AXIS not in section and any(
        arg.startswith(flag) for arg in argv):
      *parents, name = mesh_key.split(".")
      _section_at(config, parents)[name] = mesh(**{partitioning.STAGE_AXIS: 1}, **section)


class _ConfigFileParser(flags.ArgumentParser):
  """--config's file, read by load_config_file: each thing wrong with it is one UserError.

  config_flags' own parser defers an unreadable file's error, passes others
  on as they are or with a traceback in their text, and a file without
  get_config() comes out as a missing config key ("config_config").
  """

  def __init__(self, sys_argv: Optional[list[str]] = None):
    super().__init__()
    self._argv = sys_argv

  def parse(self, argument: str) -> ml_collections.ConfigDict:
    config = load_config_file(argument)
    _add_stage_axis(config, self._argv if self._argv is not None else sys.argv)
    config.lock()
    return config

  def flag_type(self) -> str:
    return "config object"


def call_from_file(path: str | pathlib.Path, function: str, what: str, *args) -> Any:
  """`function(*args)` of the Python file `path`, which a message calls `what`.

  Whatever is wrong with the file (missing, failing to load, without the
  function, or the function raising) is one UserError naming it, the line and
  the exception. A UserError from the call (a preset it loads) is its own.
  """
  path = pathlib.Path(path)
  if not path.is_file():
    raise UserError(f"{what} {path} does not exist")
  spec = importlib.util.spec_from_file_location(path.stem, path)
  if spec is None:  # Python loads a file by its suffix.
    raise UserError(f"{what} {path} is not a Python file (.py)")
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except Exception as e:  # pylint: disable=broad-except  # Whatever the user's file raises.
    raise UserError(f"{what} {path} fails to load: {_failure(e, path)}") from None
  if not callable(getattr(module, function, None)):
    raise UserError(f"{what} {path} defines no {function}()")
  try:
    return getattr(module, function)(*args)
  except UserError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    raise UserError(f"{function}() of {what} {path} raised {_failure(e, path)}") from None


def _failure(error: Exception, path: pathlib.Path) -> str:
  """'ValueError at line 2: why': the exception and the line of `path` that raised (or, for a
  SyntaxError, holds) it."""
  lines = [f.lineno for f in traceback.extract_tb(error.__traceback__)
           if pathlib.Path(f.filename).absolute() == path.absolute()]
  if isinstance(error, SyntaxError) and error.lineno:
    lines = [error.lineno]
  text = (error.msg if isinstance(error, SyntaxError) else str(error)).strip()
  return (type(error).__name__ + (f" at line {lines[-1]}" if lines else "")
          + (f": {text.splitlines()[0]}" if text else ""))


def _type_name(tp) -> str:
  return getattr(tp, "__name__", str(tp))


def _check_scalar(key: str, value: Any, tp) -> Any:
  if tp is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if tp in (int, float) and isinstance(value, bool) or not isinstance(value, tp):
    raise UserError(f"config key {key} must be {_type_name(tp)}, got {type(value).__name__} {value!r}")
  return value


REPLACED_KEYS = {"trainer.eval_batches": ("trainer.eval_tokens", "the eval set's size in tokens "
                                          "(or 'all'), whatever the batch size")}


def replacement(key: str, shown: str) -> str:
  """What to set instead of the replaced `key`, which the user wrote as `shown`."""
  new, meaning = REPLACED_KEYS[key]
  return f"config key {shown} was replaced: set config.{new}, {meaning}"



# Keys that were renamed: old key -> its new key. An old key in a config file, a flag or a
# config.json still works; the first two warn, naming the new key.
ALIASES = {
    **{f"model.{k}": f"model.compute.{k}" for k in (
        "remat", "dtype", "param_dtype", "attention_impl", "scan_layers",
        "cross_entropy_block_size")},
    **{f"model.{k}": f"model.moe.{k}" for k in (
        "num_experts", "num_experts_per_token", "router_aux_loss_coef")},
    "trainer.checkpoint_every_steps": "checkpoint.every_steps",
    "trainer.keep_checkpoints": "checkpoint.keep",
    "trainer.checkpoint_every_minutes": "checkpoint.every_minutes",
    "trainer.keep_checkpoint_every_steps": "checkpoint.keep_every_steps",
    "trainer.load_checkpoint_path": "checkpoint.load_path",
    "trainer.load_checkpoint_items": "checkpoint.load_items",
    "trainer.start_fresh_if_unusable": "checkpoint.start_fresh_if_unusable",
    "trainer.resume_without_config": "checkpoint.resume_without_config",
    **{f"trainer.{k}": f"monitoring.{k}" for k in (
        "profiler", "profiler_start_step", "profiler_num_steps", "hang_watchdog_seconds")},
    **{f"trainer.{k}": f"batch_search.{k}" for k in (
        "target_batch_size", "memory_fraction", "memory_budget_bytes")},
}


def modern_key(key: str, shown: str) -> str:
  """`key` ("trainer.keep_checkpoints"), renamed if it is an old name, with a warning naming the
  new one; `shown` is how the user wrote it."""
  if key not in ALIASES:
    return key
  # Printed, not logged: flags are parsed before absl's logging is set up.
  print(f"warning: config key {shown} is deprecated: use config.{ALIASES[key]}", file=sys.stderr)
  return ALIASES[key]


def modern_argv(argv: list[str]) -> list[str]:
  """`argv` with each --config.<old key> override renamed to its new key (ALIASES), warned.

  Also rewrites sys.argv: config_flags finds the override flags there.
  """
  renamed = []
  for arg in argv:
    name, sep, value = arg.partition("=")
    for prefix in ("--config.", "--noconfig."):  # --noconfig.KEY: a boolean set False.
      if name.startswith(prefix):
        arg = f"{prefix}{modern_key(name.removeprefix(prefix), name)}{sep}{value}"
    renamed.append(arg)
  if sys.argv[1:] == argv[1:]:  # app.run's own argv, not a test's list.
    sys.argv[:] = renamed
  return renamed


def parse_flags(argv: list[str]) -> list[str]:
  """For app.run of a command with define_config_flag: cli.parse_flags on modern_argv; what
  config_flags raises on a bad override ends the program in one line."""
  from levanter_flax.core import cli  # pylint: disable=g-import-not-at-top
  try:
    return cli.parse_flags(modern_argv(argv))
  except Exception as e:  # pylint: disable=broad-except  # What config_flags lets through raw.
    exit_with_error(_describe_flag_error(e, argv))


def _config_path(argv: list[str]) -> str:
  for i, arg in enumerate(argv):
    if arg.startswith("--config="):
      return arg.split("=", 1)[1]
    if arg == "--config" and i + 1 < len(argv):
      return argv[i + 1]
  return "?"


def _describe_flag_error(error: Exception, argv: list[str]) -> str:
  """One line for whatever config_flags raised while applying an override."""
  while error.args and isinstance(error.args[0], Exception):  # config_dict nests KeyErrors.
    error = error.args[0]
  text = str(error.args[0] if error.args else error)
  if isinstance(error, (AttributeError, KeyError)):
    unknown = re.search(r"'(\w+)'", text)
    overrides = [a for a in argv if unknown and a.startswith("--config.") and unknown.group(1) in a]
    hint = re.search(r"Did you mean \"(\w+)\"", text)
    culprit = overrides[0].split("=", 1)[0] if overrides else (unknown.group(1) if unknown else text)
    if culprit.removeprefix("--config.") in REPLACED_KEYS:
      return replacement(culprit.removeprefix("--config."), culprit)
    return f"unknown config key {culprit}" + (f" (did you mean {hint.group(1)!r}?)" if hint else "")
  first_line = text.strip().splitlines()[0] if text.strip() else type(error).__name__
  return f"config {_config_path(argv)}: {first_line}"


def _values(config: ml_collections.ConfigDict, sections: dict[str, type]) -> dict[str, Any]:
  """{"trainer.batch_size": 32, ...}: every setting `config` sets, old names renamed (warned)."""
  values = {}
  for name in config.keys():
    if name not in sections:
      raise UserError(f"unknown config section config.{name}")
    _read_section(config[name], sections[name], name, values)
  return values


def _read_section(section: Any, cls: type, path: str, values: dict[str, Any]) -> None:
  if not isinstance(section, ml_collections.ConfigDict):
    names = ", ".join(f.name for f in dataclasses.fields(cls))
    raise UserError(f"config key config.{path} must be a ConfigDict of {names}; got {section!r}")
  fields = {f.name: f for f in dataclasses.fields(cls)}
  for name in section.keys():
    key = f"{path}.{name}"
    if name in fields and schema.is_section(fields[name]):
      _read_section(section[name], type(fields[name].default), key, values)
    elif name in fields:
      values.setdefault(key, section[name])
    elif key in REPLACED_KEYS:
      raise UserError(replacement(key, f"config.{key}"))
    elif key in ALIASES:  # Over the new key's default, which the file kept.
      values[modern_key(key, f"config.{key}")] = section[name]
    else:
      raise UserError(f"unknown config key config.{key}")


def _build(cls: type, path: str, values: dict[str, Any]):
  """`cls` from the settings under `path` in `values`, each converted or type-checked."""
  hints = typing.get_type_hints(cls)
  kwargs = {}
  for field in dataclasses.fields(cls):
    key = f"{path}.{field.name}"
    if schema.is_section(field):
      kwargs[field.name] = _build(type(field.default), key, values)
    elif key in values:
      convert = field.metadata.get("convert")
      value = values[key]
      kwargs[field.name] = (convert(f"config.{key}", value) if convert
                            else _check_scalar(f"config.{key}", value, hints[field.name]))
    elif field.default is dataclasses.MISSING:
      raise UserError(f"config key config.{key} is missing")
  return cls(**kwargs)


def run_config_of_flags(flag_values: flags.FlagValues = flags.FLAGS) -> RunConfig:
  """to_run_config of a command's --config, with the keys its --config.KEY=VALUE flags set."""
  return to_run_config(flag_values.config, config_flags.get_override_values(flag_values["config"]))


def to_run_config(config: ml_collections.ConfigDict,
                  set_on_command_line: Collection[str] = ()) -> RunConfig:
  """Validates `config` and returns it as plain typed objects. `set_on_command_line`: the keys
  ("model.num_layers") the user set by flag, over the config file's."""
  model = config.get("model")
  architecture = (model.get("architecture", "gpt2") if isinstance(model, ml_collections.ConfigDict)
                  else "gpt2")
  if architecture not in models.FAMILIES:
    raise UserError(f"config.model.architecture must be one of {', '.join(models.FAMILIES)}; "
                    f"got {architecture!r}")
  sections = settings.sections(architecture)
  values = _values(config, sections)
  run = RunConfig(**{name: _build(cls, name, values) for name, cls in sections.items()})
  run = dataclasses.replace(run, sharding=dataclasses.replace(
      run.sharding, rules=run.sharding.rules + models.family(run.model).partition_rules))
  _check_across_sections(run)
  if run.trainer.init_from_hf:
    run = _model_of_checkpoint(run, set_on_command_line)
  return run


def _model_of_checkpoint(run: RunConfig, set_on_command_line: Collection[str]) -> RunConfig:
  """`run` with the model settings that config.trainer.init_from_hf's config.json decides
  (hf.decided_by_checkpoint) taken from it: a config file's shape is a template, so any
  checkpoint of the family starts without restating it. Decided before anything is built, the
  same on every process (each reads the same file), and saved as the run's config, so its
  resumes agree. A flag is the user's word: one that config.json contradicts is refused, as is
  a checkpoint of another family."""
  directory = paths.resolve(run.trainer.init_from_hf, "config.trainer.init_from_hf")
  checkpoint = snapshot.read_config(directory)
  file = directory / "config.json"
  if checkpoint.architecture != run.model.architecture:
    raise UserError(f"{file} (config.trainer.init_from_hf) holds a {checkpoint.architecture} "
                    f"model, but config.model.architecture is {run.model.architecture!r}: "
                    f"start from a {checkpoint.architecture} config, e.g. "
                    f"--config={checkpoint.architecture}")
  decided = snapshot.decided_by_checkpoint(checkpoint)
  for name in decided:
    ours, theirs = snapshot.setting_of(run.model, name), snapshot.setting_of(checkpoint, name)
    if f"model.{name}" in set_on_command_line and ours != theirs:
      raise UserError(f"--config.model.{name}={ours!r} disagrees with {file} "
                      f"(config.trainer.init_from_hf), which has {theirs!r}: drop the flag; "
                      f"the checkpoint decides config.model.{name}")
  return dataclasses.replace(run, model=snapshot.with_settings(
      run.model, {name: snapshot.setting_of(checkpoint, name) for name in decided}))


def _check_across_sections(run: RunConfig) -> None:
  """What no one section can check of itself."""
  if run.trainer.init_from_hf and run.checkpoint.load_path:
    raise UserError("set config.trainer.init_from_hf or config.checkpoint.load_path, not both")
  if run.model.lora.rank and run.checkpoint.load_path:
    raise UserError("config.checkpoint.load_path cannot start a LoRA run "
                    "(config.model.lora.rank > 0): export that run (levanter-flax export-hf) and "
                    "start from it with config.trainer.init_from_hf")
  if run.monitoring.profiler and run.monitoring.profiler_start_step > run.trainer.num_train_steps:
    raise UserError(f"config.monitoring.profiler_start_step ({run.monitoring.profiler_start_step}) "
                    f"is after the last step, config.trainer.num_train_steps "
                    f"({run.trainer.num_train_steps})")
  if (run.trainer.batch_size != "auto"
      and run.trainer.batch_size % run.trainer.gradient_accumulation_steps):
    raise UserError(f"config.trainer.batch_size ({run.trainer.batch_size}) must be divisible by "
                    f"config.trainer.gradient_accumulation_steps "
                    f"({run.trainer.gradient_accumulation_steps})")
  if run.trainer.nan_policy not in ("halt", "skip"):
    raise UserError(f"config.trainer.nan_policy must be 'halt' or 'skip'; "
                    f"got {run.trainer.nan_policy!r}")
  if run.optimizer.name == "sophia_h" and run.model.compute.quantization != "none":
    raise UserError(f"config.optimizer.name=sophia_h needs config.model.compute.quantization="
                    f"none: its Hessian-vector products cannot differentiate "
                    f"{run.model.compute.quantization}'s straight-through gradient")
  _check_optimizer(run.optimizer, run.trainer.num_train_steps)


def _settings_of(value: Any, prefix: str = ""):
  """(key, value) of every setting of a RunConfig (or a section under `prefix`)."""
  if dataclasses.is_dataclass(value):
    for field in dataclasses.fields(value):
      yield from _settings_of(getattr(value, field.name),
                              f"{prefix}.{field.name}" if prefix else field.name)
  else:
    yield prefix, value


def flat_dict(run: RunConfig) -> dict[str, Any]:
  """{'model.num_layers': 12, ...}, every setting, JSON-ready: what a workdir's config.json
  holds."""
  return json.loads(json.dumps(dict(_settings_of(run))))


def model_from_saved(saved: dict[str, Any]) -> Any:
  """The model config that a config.json (read_saved) describes."""
  architecture = saved.get("model.architecture", "gpt2")
  if architecture not in models.FAMILIES:
    raise UserError(f"model.architecture {architecture!r} is none of {', '.join(models.FAMILIES)}")
  return _build(models.FAMILIES[architecture].config, "model", saved)


def describe_config(run: RunConfig) -> str:
  """Every setting of `run` with its value as the run reads it, its default where the two
  differ, and its description: what --print_config prints, section by section."""
  values = dict(_settings_of(run))
  family_rules = models.family(run.model).partition_rules  # Always there: not the config's.
  values["sharding.rules"] = run.sharding.rules[:len(run.sharding.rules) - len(family_rules)]
  docs = {f.name: f.metadata["doc"] for f in dataclasses.fields(RunConfig)}
  lines = []
  for name, section in settings.sections(run.model.architecture).items():
    lines.append(f"# config.{name}: {docs[name]}")
    for declared in schema.declared(section, name):
      line = f"config.{declared.key} = {values[declared.key]!r}"
      if declared.default is dataclasses.MISSING:
        line += "  (no default)"
      elif declared.default != values[declared.key]:
        line += f"  (default {declared.default!r})"
      lines += [line, f"    {declared.doc} [{declared.kind}]"]
  return "\n".join(lines)


def modern_saved(saved: dict[str, Any]) -> dict[str, Any]:
  """A config.json's keys as today's: old names renamed (ALIASES), and a nested section that an
  older version saved as one object (trainer.distributed) spread into its settings."""
  flat = {}
  for key, value in saved.items():
    if isinstance(value, dict):
      flat |= modern_saved({f"{key}.{k}": v for k, v in value.items()})
    else:
      flat[ALIASES.get(key, key)] = value
  return flat


def read_saved(workdir: epath.Path) -> Optional[dict[str, Any]]:
  """<workdir>/config.json: the config its checkpoints were written with; None if there is none.

  Raises OSError or ValueError when it cannot be read or is not a JSON object.
  """
  try:
    saved = json.loads((workdir / "config.json").read_text())
  except FileNotFoundError:
    return None
  if not isinstance(saved, dict):
    raise ValueError("not a JSON object")
  return modern_saved(saved)


# What a run from before a key existed did, where that is not the key's default.

# What a run from before a key existed did, where that is not the key's default.
_BEFORE_THE_KEY = {"data.document_masking": False,
                   "model.compute.splash_fused_backward": False}


def defaults(architecture: str) -> dict[str, Any]:
  """Every key that has a default, with the value a config.json without it means: the
  default, which its run did, or what it did before the key existed (_BEFORE_THE_KEY)."""
  found = {d.key: d.default for d in settings.declared(architecture)
           if d.default is not dataclasses.MISSING}
  return json.loads(json.dumps(found | _BEFORE_THE_KEY))


def _architecture(saved: dict[str, Any]) -> str:
  architecture = saved.get("model.architecture", "gpt2")  # The only family before there was a key.
  return architecture if architecture in models.FAMILIES else "gpt2"


def changes(saved: dict[str, Any], now: dict[str, Any],
            keys: Optional[Sequence[str]] = None) -> list[str]:
  """'model.num_layers 12 -> 24' for each key (of `keys`, or any) whose value differs."""
  for old, (new, _) in REPLACED_KEYS.items():  # Written before `new`: nothing to compare it with.
    if old in saved and new not in saved:
      saved = {**{k: v for k, v in saved.items() if k != old}, new: now.get(new)}
  saved = {**{k: v for k, v in defaults(_architecture(saved)).items() if k in now}, **saved}
  keys = sorted(set(saved) | set(now) if keys is None else keys)
  return [f"{k} {saved.get(k)} -> {now.get(k)}" for k in keys if saved.get(k) != now.get(k)]


def state_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
  """The changes that make a checkpoint written under `saved` unusable under `now`: of the
  settings that shape either run's state (schema.STATE)."""
  keys = {k for flat in (saved, now)
          for k in settings.keys_of_kind(schema.STATE, _architecture(flat))}
  return changes(saved, now, sorted(k for k in keys if k in now or k in saved))


def chosen_at_start(flat: dict[str, Any]) -> tuple[str, ...]:
  """The settings of a run (flat_dict form) that its start chooses (schema.CHOSEN): those whose
  chosen_when holds, e.g. trainer.batch_size while it is "auto"."""
  return tuple(d.key for d in settings.declared(_architecture(flat))
               if d.kind == schema.CHOSEN and flat.get(d.chosen_when[0]) == d.chosen_when[1])


def keep_chosen(wanted: dict[str, Any], saved: Optional[dict[str, Any]]) -> dict[str, Any]:
  """`wanted` with what its run chose when it first started, as `saved` (its config.json)
  holds it; unchanged for a run that has not started."""
  if not saved:
    return wanted
  return {**wanted, **{k: saved[k] for k in chosen_at_start(wanted) if k in saved}}


def _check_optimizer(chosen: optimizers.OptimizerConfig, num_train_steps: int) -> None:
  """A known optimizer and schedule, no key set that neither would silently ignore, and a
  schedule that fits num_train_steps."""
  for key, known in (("name", optimizers.OPTIMIZERS), ("schedule", schedules.SCHEDULES)):
    if getattr(chosen, key) not in known:
      raise UserError(f"config.optimizer.{key} must be one of {', '.join(known)}; "
                      f"got {getattr(chosen, key)!r}")
  default = optimizers.OptimizerConfig()
  for key in optimizers.ignored_keys(chosen.name, chosen.schedule):
    if getattr(chosen, key) != getattr(default, key):
      raise UserError(f"config.optimizer.{key} ({getattr(chosen, key)}) does not apply to "
                      f"{_reader_of(key, chosen)}: set it back to its default "
                      f"({getattr(default, key)}) or choose another {_chooser_of(key)}")
  optimizers.learning_rate_schedule(chosen, num_train_steps)  # Its own checks (WSD's warmup).


def _is_schedule_key(key: str) -> bool:
  return any(key in schedule.keys for schedule in schedules.SCHEDULES.values())


def _reader_of(key: str, chosen: optimizers.OptimizerConfig) -> str:
  """The chosen schedule (for a key some schedule reads) or optimizer, and what it reads."""
  if _is_schedule_key(key):
    reads = schedules.SCHEDULES[chosen.schedule].keys
    return (f"the {chosen.schedule} schedule, which reads only "
            f"{', '.join(reads + ('learning_rate', 'warmup_steps'))}")
  reads = ", ".join(optimizers.OPTIMIZERS[chosen.name].keys)
  return f"{chosen.name}, which reads only {reads} besides the schedule"


def _chooser_of(key: str) -> str:
  return "schedule (config.optimizer.schedule)" if _is_schedule_key(key) else "optimizer"


def model_like(model: ml_collections.ConfigDict, architecture: str,
               **values) -> ml_collections.ConfigDict:
  """model_config(architecture, **values), with `model`'s shape (the keys the family requires:
  vocab_size, seq_len, layers, heads, widths) and compute section where `values` does not say.

  Any other key is the family's default, not `model`'s (rope_theta, sliding_window): one family's
  run with another's model, e.g. configs/mixtral.py:8x7b, configs/mistral.py:7b's run.
  """
  family = models.FAMILIES.get(architecture)  # None: model_config names the unknown family.
  shape = [f.name for f in dataclasses.fields(family.config)
           if f.default is dataclasses.MISSING] if family else []
  kept = {key: model[key] for key in shape if key in model} | {"compute": model.compute.to_dict()}
  return model_config(architecture, **{**kept, **values})


def sibling_config(file: str, sibling: str, variant: str) -> ml_collections.ConfigDict:
  """get_config(variant) of config file `sibling`, beside `file` (a config file's __file__).

  configs/ is no package: its files are loaded by path, and find each other by their own,
  wherever the command runs.
  """
  return call_from_file(pathlib.Path(file).parent / sibling, "get_config", "config file", variant)


def choose_variant(file: str, variant: Optional[str],
                   variants: dict[str, typing.Callable[[], ml_collections.ConfigDict]],
                   default: str) -> ml_collections.ConfigDict:
  """get_config(variant) of a config file of several variants (--config=FILE:VARIANT): the
  ConfigDict of variants[variant](), or of `default` when none is given."""
  chosen = default if variant is None else variant
  if chosen not in variants:
    raise UserError(f"config file {_shown(file)}: unknown variant {chosen!r}; choose one of "
                    f"{', '.join(variants)}")
  return variants[chosen]()


def variant_file(file: str, sibling: str,
                 variant: str) -> typing.Callable[[Optional[str]], ml_collections.ConfigDict]:
  """get_config() of a config file kept for its name (configs/gpt2_nano.py): `variant` of
  config file `sibling` beside it. It takes no variant of its own."""

  def get_config(argument: Optional[str] = None) -> ml_collections.ConfigDict:
    if argument is not None:
      raise UserError(f"config file {_shown(file)} is {sibling}:{variant} and takes no variant; "
                      f"got {argument!r} (for a variant of {sibling}: --config="
                      f"{_shown(pathlib.Path(file).parent / sibling)}:{argument})")
    return sibling_config(file, sibling, variant)

  return get_config


def _shown(file: str | pathlib.Path) -> str:
  """A config file as a message names it: a shipped config found by name by its name (gpt2,
  not the package's path), else relative to the working directory when inside it, as --config
  most often names it (a module's __file__ is absolute)."""
  path = pathlib.Path(file)
  if path.is_relative_to(SHIPPED_CONFIGS):  # Not through a checkout's configs/ link.
    return path.relative_to(SHIPPED_CONFIGS).with_suffix("").as_posix()
  return str(path.relative_to(pathlib.Path.cwd()) if path.is_relative_to(pathlib.Path.cwd())
             else path)


def run_name(config_argument: str) -> str:
  """The default workdir's name for --config=FILE[:VARIANT]: FILE's stem, then _VARIANT
  (configs/gpt2.py:nano -> gpt2_nano, as configs/gpt2_nano.py)."""
  path, *variant = config_argument.split(":", 1)
  return "_".join([pathlib.Path(path).stem, *variant])
