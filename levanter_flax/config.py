"""The config schema: defaults, validation, and conversion to plain typed objects.

Config files in configs/ start from `default_config()` and change what they
need. `to_run_config` is the edge: it checks every key and type and returns
small frozen dataclasses, so no code below it touches a ConfigDict.
"""
import dataclasses
import importlib.util
import json
import pathlib
import re
import traceback
import typing
from typing import Any, Optional, Sequence

import ml_collections
from absl import flags
from etils import epath
from ml_collections import config_flags

from levanter_flax import checks, models, optim
from levanter_flax.data import DataConfig
from levanter_flax.distributed import DistributedConfig
from levanter_flax.errors import UserError
from levanter_flax.models import common
from levanter_flax.optim import OptimizerConfig
from levanter_flax.partitioning import ShardingConfig
from levanter_flax.settings import RunConfig, TrainerConfig


def mesh(**axes: int) -> ml_collections.ConfigDict:
  """An axis-name -> size mapping that keeps the order the axes were given in."""
  return ml_collections.ConfigDict(axes, sort_keys=False)


def default_config() -> ml_collections.ConfigDict:
  """GPT-2 small (124M) on the built-in corpus; configs/ files start from this."""
  config = ml_collections.ConfigDict()

  config.model = ml_collections.ConfigDict()
  # Or another family of models.FAMILIES: config.model = model_config("llama", ...).
  config.model.architecture = "gpt2"
  config.model.vocab_size = 50257  # GPT-2's; must cover the tokenizer's vocabulary.
  config.model.seq_len = 1024
  config.model.num_layers = 12
  config.model.num_heads = 12
  config.model.hidden_dim = 768
  # Gradient checkpointing per block: none, full (recompute the block),
  # dots_saveable, dots_with_no_batch_dims_saveable, or offload (saved matmul
  # outputs wait in host memory, where the backend supports it). True = full.
  config.model.remat = "none"
  config.model.dtype = "float32"  # Compute: float32, bfloat16 or float16.
  config.model.param_dtype = "float32"  # Parameters and optimizer; the loss is always float32.
  # xla, cudnn (flash attention on NVIDIA GPUs), or auto: cudnn there in 16-bit, else xla.
  config.model.attention_impl = "auto"
  # Run the blocks as one lax.scan over stacked parameters: compile time stays
  # flat as depth grows. Partition rules apply to the trailing axes.
  config.model.scan_layers = False
  # > 0: the loss computes logits this many vocabulary entries at a time and
  # never holds them all (32 x 1024 x 50304 float32 logits are 6.6 GB). 0: plain.
  config.model.cross_entropy_block_size = 0
  config.model.layer_norm_epsilon = 1e-5
  config.model.initializer_range = 0.02
  # The LM head is the token embedding (GPT-2's way). False: a separate lm_head matrix
  # (vocab_size x hidden_dim more parameters), as in HF checkpoints with tie_word_embeddings=false.
  config.model.tie_word_embeddings = True

  config.trainer = ml_collections.ConfigDict()
  # Global, in sequences; or "auto": the largest microbatch that fits in memory
  # (see batch_search.py), with accumulation up to target_batch_size.
  config.trainer.batch_size = ml_collections.FieldReference(32, field_type=object)
  config.trainer.num_train_steps = 10_000
  config.trainer.log_every_steps = 10
  config.trainer.eval_every_steps = 500
  # The eval set: this many tokens' worth of seq_len windows, spread evenly over the whole
  # validation split (of each source), the same at every eval whatever the batch layout;
  # "all": every window of the split (held in host memory). Its standard error is logged.
  config.trainer.eval_tokens = ml_collections.FieldReference(1 << 20, field_type=object)
  config.trainer.checkpoint_every_steps = 500
  config.trainer.keep_checkpoints = 3  # The newest ones, temporary ones included.
  # Also save every this many minutes (0: never), at the next log step;
  # process 0's clock decides for every process. Such a checkpoint is
  # temporary: deleted once a newer one is written, even after a restart.
  config.trainer.checkpoint_every_minutes = 0.0
  # Keep every checkpoint whose step is a multiple of this for good (0: none).
  config.trainer.keep_checkpoint_every_steps = 0
  # Start a new run from another run's checkpoint (<workdir>/checkpoints/<step>):
  # "params" only (step 0, fresh optimizer and data), or the whole "state"
  # (step, optimizer state and data position too). Ignored once this run has
  # checkpoints of its own.
  config.trainer.load_checkpoint_path = ""
  config.trainer.load_checkpoint_items = "params"
  # Or start from a Hugging Face GPT-2 or Llama directory (config.json +
  # safetensors) whose shape matches config.model; fresh optimizer and data.
  config.trainer.init_from_hf = ""
  # A damaged newest checkpoint (missing, truncated or garbled files) is set
  # aside as <step>.unreadable and the one before it used; when all are
  # damaged the run stops, unless this lets it start over. A checkpoint of
  # another model or optimizer, or one the storage fails to read, is never
  # set aside: the run stops naming it.
  config.trainer.start_fresh_if_unusable = False
  # Checkpoints without the config.json they were written with cannot be checked against this
  # config (model, optimizer, data order); they are refused unless this resumes them unchecked.
  config.trainer.resume_without_config = False
  config.trainer.seed = 0
  # Axis name -> size; -1 takes all remaining devices.
  config.trainer.device_mesh = mesh(data=-1, model=1)
  # On a CPU backend, split each process's CPU into this many XLA devices (0:
  # JAX's default, one). Small models run faster data-parallel, one device per
  # core, than on one device whose ops are too small to split between cores.
  config.trainer.cpu_devices = 0
  # A step with a non-finite loss or gradient never updates the params; then
  # "halt" stops the run naming the step, "skip" warns, counts it and goes on.
  config.trainer.nan_policy = "halt"
  # With "skip": this many skipped steps in a row mean the run has diverged; it halts.
  config.trainer.max_consecutive_skipped_steps = 10
  # Splits each batch into this many microbatches, summed inside one jitted step.
  config.trainer.gradient_accumulation_steps = 1
  # Compiled programs are kept here across runs (a shared path serves many
  # nodes); "" uses $JAX_COMPILATION_CACHE_DIR if set, else no cache.
  config.trainer.jax_compilation_cache_dir = ""
  config.trainer.jax_persistent_cache_min_compile_time_secs = 1.0
  # For train/mfu; 0 looks the device up in metrics.PEAK_FLOPS.
  config.trainer.peak_flops_per_device = 0.0
  # For batch_size="auto": the global batch to reach by accumulation (0: what
  # fits, no accumulation), and the memory to fit in: memory_fraction of the
  # device's, or memory_budget_bytes per device where the backend does not say (CPU).
  config.trainer.target_batch_size = 0
  config.trainer.memory_fraction = 0.85
  config.trainer.memory_budget_bytes = 0
  # Multi-process runs (launch/README.md). Set process 0's host:port, the
  # process count and this process's id; or leave the address "" to detect a
  # TPU pod slice, a SLURM job of several tasks or a Kubernetes indexed Job,
  # and otherwise run as one process.
  config.trainer.distributed = ml_collections.ConfigDict()
  config.trainer.distributed.coordinator_address = ""
  config.trainer.distributed.num_processes = 0
  config.trainer.distributed.process_id = -1
  config.trainer.distributed.local_device_ids = ""  # e.g. "0,1"; "" drives all of the host's.
  config.trainer.distributed.initialization_timeout_seconds = 300
  # Trace steps [profiler_start_step, +profiler_num_steps) into the workdir for
  # TensorBoard's profile plugin; start after compilation and warm-up.
  config.trainer.profiler = False
  config.trainer.profiler_start_step = 5
  config.trainer.profiler_num_steps = 5
  # Log every thread's stack when no step finishes for this long (0: off).
  config.trainer.hang_watchdog_seconds = 1800.0

  config.optimizer = ml_collections.ConfigDict()
  # A key of optim.OPTIMIZERS: adamw, lion, adafactor or sophia_h. A key below that the
  # chosen one does not read must keep its default. configs/optim/ holds presets (load_preset).
  config.optimizer.name = "adamw"
  config.optimizer.learning_rate = 6e-4  # Peak, after linear warmup; cosine decay follows.
  config.optimizer.warmup_steps = 200
  config.optimizer.min_learning_rate_ratio = 0.1  # Final LR as a fraction of the peak.
  config.optimizer.weight_decay = 0.1  # AdamW; never on biases or LayerNorm.
  config.optimizer.max_grad_norm = 1.0  # Global-norm clipping; 0 turns it off.
  config.optimizer.beta1 = 0.9
  config.optimizer.beta2 = 0.95
  config.optimizer.epsilon = 1e-8
  # sophia_h: a Hutchinson estimate of the Hessian's diagonal every this many
  # steps, and the Hessian's scale in the update's denominator (the paper's gamma).
  config.optimizer.hessian_update_interval = 10
  config.optimizer.sophia_gamma = 0.01

  config.data = ml_collections.ConfigDict()
  # A directory written by `python -m levanter_flax.prepare`, or "stdlib": the
  # Python standard library's sources, tokenized into cache_dir on first use.
  config.data.dataset = "stdlib"
  # Named datasets with weights, replacing `dataset` when set, e.g.
  # mixture.code = dict(dataset="/data/code", weight=0.7).
  config.data.mixture = ml_collections.ConfigDict()
  # Must be what the data was tokenized with: "byte" (256 bytes + EOS, nothing
  # to download), a tokenizer.json or a SentencePiece .model file.
  config.data.tokenizer = "byte"
  config.data.cache_dir = ""  # For "stdlib"; "" is ~/.cache/levanter_flax.
  config.data.validation_fraction = 0.02  # For "stdlib": documents held out for eval.
  config.data.num_train_shards = 8  # For "stdlib".
  # A train shard that decodes to other counts than its manifest lists (truncated,
  # corrupt, another token dtype): "fail" stops naming it; "skip" leaves it out, counted.
  config.data.on_corrupt_record = "fail"
  # The train and validation shards are dealt to this many reader groups, each
  # supplying a fixed slice of every batch; each process reads its groups'
  # shards only. The batches depend on this count alone, not on the number of
  # processes, so a run resumes exactly on any process count that divides it.
  # 0: chosen when the run first starts (up to 8, dividing the batch size and
  # at most the shard count; see loader.default_reader_groups). Either way it
  # is fixed then, saved with the run, and a different value is refused.
  config.data.reader_groups = 0
  # Windows pack several documents, EOS after each. On: a token attends only to
  # its own document (EOS opens a document, as a BOS) and positions restart at
  # each, so a window's loss is the sum of its documents' alone, as the model
  # will see them at inference. Off: attention crosses documents (GPT-2's and
  # nanoGPT's recipe), a little faster.
  config.data.document_masking = True
  # A checkpoint's data position counts in the datasets it was read from (their manifests'
  # hashes). A dataset prepared again or replaced under the same path is refused on resume;
  # True reads such a dataset from its start instead.
  config.data.restart_changed_datasets = False

  config.sharding = ml_collections.ConfigDict()
  # (regex, axes) rules tried before the model family's own (models/<family>.py's
  # PARTITION_RULES, in logical axes), which are always there: only to override them.
  config.sharding.rules = ()
  # Mesh axes as a name or comma-separated names ("data,model"); "" is none.
  config.sharding.activation_axis = "data"  # Splits the batch: data parallelism.
  config.sharding.parameter_axis = ""  # ZeRO-3: also shard every parameter.
  config.sharding.optimizer_axis = ""  # ZeRO-1: also shard optimizer state.
  # Where the logical heads, kv_heads, MLP and vocab dimensions go, of parameters (as the
  # rules name them) and activations alike.
  config.sharding.tensor_axis = "model"
  # Where a mixture of experts' experts go (logical axis "experts"): expert parallelism.
  config.sharding.expert_axis = ""
  config.sharding.strict = False  # Refuse parameters that no rule matches.
  return config


def model_config(architecture: str, **values) -> ml_collections.ConfigDict:
  """The model section of a family: its config dataclass's fields, defaults unless in `values`.

  A config file does config.model = model_config("qwen2", vocab_size=..., ...)
  and gets the family's partition rules with it. The compute keys
  (remat, dtype, param_dtype, attention_impl, scan_layers,
  cross_entropy_block_size) mean what they mean for GPT-2; the family's module
  documents the rest.
  """
  if architecture not in models.FAMILIES:
    raise UserError(f"unknown model architecture {architecture!r}; known: "
                    f"{', '.join(models.FAMILIES)}")
  model = ml_collections.ConfigDict()
  model.architecture = architecture
  for field in dataclasses.fields(models.FAMILIES[architecture].config):
    if field.name == "architecture":
      continue
    if field.name in values:
      model[field.name] = values[field.name]
    elif field.default is not dataclasses.MISSING:
      model[field.name] = field.default
    else:
      raise UserError(f"model_config({architecture!r}) needs {field.name}")
  return model


def llama_model_config() -> ml_collections.ConfigDict:
  """The model section of a Llama (TinyLlama-1.1B's shape); set the sizes after."""
  # Grouped-query attention: each key/value head serves 8 query heads; SwiGLU 5632 wide.
  return model_config("llama", vocab_size=32000, seq_len=2048, num_layers=22, num_heads=32,
                      num_kv_heads=4, hidden_dim=2048, intermediate_dim=5632)


def load_preset(path: str | pathlib.Path) -> ml_collections.ConfigDict:
  """get_config() of a config fragment such as configs/optim/sophia_h_large.py.

  A config file merges it into a section: config.optimizer.update(load_preset(...)).
  """
  return call_from_file(path, "get_config", "config preset")


def load_config_file(argument: str) -> ml_collections.ConfigDict:
  """What --config=FILE[:ARG] names: get_config([ARG]) of FILE, as config_flags reads it."""
  path, *arg = argument.split(":", 1)
  config = call_from_file(path, "get_config", "config file", *arg)
  if not isinstance(config, ml_collections.ConfigDict):
    raise UserError(f"get_config() of config file {path} returned a {type(config).__name__}, not "
                    f"an ml_collections.ConfigDict (did it forget to return the config?)")
  return config


def define_config_flag(help_string: str, flag_values: flags.FlagValues = flags.FLAGS,
                       sys_argv: Optional[list[str]] = None) -> flags.FlagHolder:
  """config_flags' --config (a file, and --config.KEY=VALUE overrides), its file read by
  load_config_file."""
  holder = config_flags.DEFINE_config_file("config", None, help_string, flag_values,
                                           lock_config=True, sys_argv=sys_argv)
  flag_values["config"].parser = _ConfigFileParser()
  return holder


class _ConfigFileParser(flags.ArgumentParser):
  """--config's file, read by load_config_file: each thing wrong with it is one UserError.

  config_flags' own parser defers an unreadable file's error, passes others
  on as they are or with a traceback in their text, and a file without
  get_config() comes out as a missing config key ("config_config").
  """

  def parse(self, argument: str) -> ml_collections.ConfigDict:
    config = load_config_file(argument)
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


def _axes(key: str, value: Any):
  if value is None or value == "":
    return None
  if isinstance(value, str):
    names = tuple(name.strip() for name in value.split(","))
    return names[0] if len(names) == 1 else names
  if isinstance(value, (tuple, list)) and all(isinstance(v, str) for v in value):
    return tuple(value)
  raise UserError(f"config key {key} must be a mesh axis name, names, or None; got {value!r}")


def _device_mesh(key: str, value: Any) -> tuple[tuple[str, int], ...]:
  items = list(value.items()) if hasattr(value, "items") else None
  if not items or not all(isinstance(n, str) and isinstance(s, int) for n, s in items):
    raise UserError(f"config key {key} must map axis names to sizes, e.g. data=-1, model=1; got {value!r}")
  return tuple(items)


def _mixture(key: str, value: Any) -> tuple[tuple[str, str, float], ...]:
  entries = []
  for name, entry in (value.items() if hasattr(value, "items") else [(None, value)]):
    if (not hasattr(entry, "keys") or set(entry.keys()) != {"dataset", "weight"}
        or not isinstance(entry["dataset"], str)
        or not isinstance(entry["weight"], (int, float)) or entry["weight"] <= 0):
      raise UserError(f"config key {key}.{name} must be dict(dataset=<directory>, weight=<positive "
                      f"number>); got {entry!r}")
    entries.append((name, entry["dataset"], float(entry["weight"])))
  return tuple(entries)


def _int_or(word: str):
  """A converter for keys that take a positive int or `word`."""
  def convert(key: str, value: Any) -> int | str:
    if value == word or (isinstance(value, int) and not isinstance(value, bool)):
      return value
    raise UserError(f"config key {key} must be a positive int or {word!r}; got {value!r}")
  return convert


def _remat(key: str, value: Any) -> str:
  if isinstance(value, bool) or str(value).lower() in ("true", "false"):
    return "full" if str(value).lower() == "true" else "none"
  if value not in common.REMAT_POLICIES:
    raise UserError(f"config key {key} must be True, False or one of "
                    f"{', '.join(common.REMAT_POLICIES)}; got {value!r}")
  return value


def _rules(key: str, value: Any):
  try:
    rules = tuple((pattern, tuple(spec)) for pattern, spec in value)
  except (TypeError, ValueError):
    raise UserError(f"config key {key} must be a sequence of (regex, spec) pairs; got {value!r}") from None
  for pattern, spec in rules:
    if not isinstance(pattern, str):
      raise UserError(f"config key {key}: regex {pattern!r} is not a string")
    for entry in spec:
      _axes(f"{key}[{pattern!r}]", entry)
  return tuple((pattern, tuple(_axes(key, e) for e in spec)) for pattern, spec in rules)


def _distributed(key: str, value: Any) -> DistributedConfig:
  if not isinstance(value, ml_collections.ConfigDict):
    names = ", ".join(f.name for f in dataclasses.fields(DistributedConfig))
    raise UserError(f"config key {key} must be a ConfigDict of {names}; got {value!r}")
  return _fields(DistributedConfig, value, key[len("config."):])


def _device_ids(key: str, value: Any) -> tuple[int, ...]:
  """"" (all), "0,1", 3 or [0, 1] -> a tuple of device ids."""
  try:
    if isinstance(value, str):
      return tuple(int(v) for v in value.split(",") if v.strip())
    return tuple(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))
  except (TypeError, ValueError):
    raise UserError(f"config key {key} must be device ids like \"0,1\" (\"\" for all); got {value!r}") from None


_CONVERTERS = {
    "trainer.batch_size": _int_or("auto"),
    "trainer.eval_tokens": _int_or("all"),
    "trainer.distributed": _distributed,
    "trainer.distributed.local_device_ids": _device_ids,
    "model.remat": _remat,
    "trainer.device_mesh": _device_mesh,
    "data.mixture": _mixture,
    "sharding.rules": _rules,
    "sharding.activation_axis": _axes,
    "sharding.parameter_axis": _axes,
    "sharding.optimizer_axis": _axes,
    "sharding.tensor_axis": _axes,
    "sharding.expert_axis": _axes,
}


def _section(cls, config: ml_collections.ConfigDict, name: str):
  section = config.get(name)
  if not isinstance(section, ml_collections.ConfigDict):
    raise UserError(f"config section config.{name} is missing")
  return _fields(cls, section, name)


def _model_section(config: ml_collections.ConfigDict):
  """The family's config dataclass, as config.model.architecture says."""
  section = config.get("model")
  if not isinstance(section, ml_collections.ConfigDict):
    raise UserError("config section config.model is missing")
  architecture = section.get("architecture", "gpt2")
  if architecture not in models.FAMILIES:
    raise UserError(f"config.model.architecture must be one of {', '.join(models.FAMILIES)}; "
                    f"got {architecture!r}")
  return _fields(models.FAMILIES[architecture].config, section, "model")


# Keys that were replaced: what to set instead.
# Keys that were replaced: old key -> (its replacement, what that one means).
REPLACED_KEYS = {"trainer.eval_batches": ("trainer.eval_tokens", "the eval set's size in tokens "
                                          "(or 'all'), whatever the batch size")}


def replacement(key: str, shown: str) -> str:
  """What to set instead of the replaced `key`, which the user wrote as `shown`."""
  new, meaning = REPLACED_KEYS[key]
  return f"config key {shown} was replaced: set config.{new}, {meaning}"


def _fields(cls, section: ml_collections.ConfigDict, path: str):
  """`cls` from the keys of `section`, each checked; `path` names it in errors ("trainer")."""
  fields = {f.name: f for f in dataclasses.fields(cls)}
  for key in section.keys():
    if f"{path}.{key}" in REPLACED_KEYS:
      raise UserError(replacement(f"{path}.{key}", f"config.{path}.{key}"))
    if key not in fields:
      raise UserError(f"unknown config key config.{path}.{key}")
  hints = typing.get_type_hints(cls)
  values = {}
  for field in fields.values():
    key = f"config.{path}.{field.name}"
    if field.name not in section:
      if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
        raise UserError(f"config key {key} is missing")
      continue
    convert = _CONVERTERS.get(f"{path}.{field.name}")
    value = section[field.name]
    values[field.name] = convert(key, value) if convert else _check_scalar(key, value, hints[field.name])
  return cls(**values)


def _check_rules(rules) -> None:
  for pattern, _ in rules:
    try:
      re.compile(pattern)
    except re.error as e:
      raise UserError(f"config.sharding.rules: {pattern!r} is not a valid regex: {e}") from None


# What a checkpoint's arrays and their meaning depend on: a resume that changes one is refused
# before anything is restored. Anything else may change on resume, and is logged.
STATE_KEYS = ("model.architecture", "model.vocab_size", "model.seq_len", "model.num_layers",
              "model.num_heads", "model.num_kv_heads", "model.hidden_dim", "model.intermediate_dim",
              "model.scan_layers", "model.param_dtype", "model.tie_word_embeddings", "model.qkv_bias",
              "model.num_experts", "optimizer.name")


def flat_dict(run: RunConfig) -> dict[str, Any]:
  """{'model.num_layers': 12, ...}, JSON-ready: what a workdir's config.json holds."""
  return json.loads(json.dumps({f"{section}.{key}": value
                                for section, fields in dataclasses.asdict(run).items()
                                for key, value in fields.items()}))


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
  return saved


# What a run from before a key existed did, where that is not the key's default.
_BEFORE_THE_KEY = {"data.document_masking": False}


def defaults(architecture: str) -> dict[str, Any]:
  """Every key that has a default, with the value a config.json without it means: the
  default, which its run did, or what it did before the key existed (_BEFORE_THE_KEY)."""
  sections = {f.name: f.type for f in dataclasses.fields(RunConfig)}
  sections["model"] = models.FAMILIES[architecture].config
  found = {}
  for section, cls in sections.items():
    for field in dataclasses.fields(cls):
      if field.default is not dataclasses.MISSING:
        found[f"{section}.{field.name}"] = field.default
  return json.loads(json.dumps({k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
                                for k, v in found.items()} | _BEFORE_THE_KEY))


def changes(saved: dict[str, Any], now: dict[str, Any],
            keys: Optional[Sequence[str]] = None) -> list[str]:
  """'model.num_layers 12 -> 24' for each key (of `keys`, or any) whose value differs."""
  architecture = saved.get("model.architecture", "gpt2")  # The only family before there was a key.
  missing = defaults(architecture if architecture in models.FAMILIES else "gpt2")
  saved = {**{k: v for k, v in missing.items() if k in now}, **saved}
  for old, (new, _) in REPLACED_KEYS.items():  # Written before `new`: nothing to compare it with.
    if old in saved and new not in saved:
      saved = {**{k: v for k, v in saved.items() if k != old}, new: now.get(new)}
  keys = sorted(set(saved) | set(now) if keys is None else keys)
  return [f"{k} {saved.get(k)} -> {now.get(k)}" for k in keys if saved.get(k) != now.get(k)]


def state_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
  """The changes that make a checkpoint written under `saved` unusable under `now`."""
  return changes(saved, now, [k for k in STATE_KEYS if k in now or k in saved])


def _check_optimizer(chosen: optim.OptimizerConfig) -> None:
  """A known name, and no key set that the chosen optimizer would silently ignore."""
  if chosen.name not in optim.OPTIMIZERS:
    raise UserError(f"config.optimizer.name must be one of {', '.join(optim.OPTIMIZERS)}; "
                    f"got {chosen.name!r}")
  default = default_config().optimizer
  for key in optim.ignored_keys(chosen.name):
    if getattr(chosen, key) != default[key]:
      reads = ", ".join(optim.OPTIMIZERS[chosen.name].keys)
      raise UserError(f"config.optimizer.{key} ({getattr(chosen, key)}) does not apply to "
                      f"{chosen.name}, which reads only {reads} besides the schedule: set it "
                      f"back to its default ({default[key]}) or choose another optimizer")


def to_run_config(config: ml_collections.ConfigDict) -> RunConfig:
  """Validates `config` and returns it as plain typed objects."""
  sections = {f.name: f.type for f in dataclasses.fields(RunConfig)}
  for key in config.keys():
    if key not in sections:
      raise UserError(f"unknown config section config.{key}")
  run = RunConfig(**{name: _model_section(config) if name == "model" else _section(cls, config, name)
                     for name, cls in sections.items()})
  _check_rules(run.sharding.rules)
  run = dataclasses.replace(run, sharding=dataclasses.replace(
      run.sharding, rules=run.sharding.rules + models.family(run.model).partition_rules))
  if run.trainer.load_checkpoint_items not in ("params", "state"):
    raise UserError(f"config.trainer.load_checkpoint_items must be 'params' or 'state'; "
                    f"got {run.trainer.load_checkpoint_items!r}")
  if run.trainer.init_from_hf and run.trainer.load_checkpoint_path:
    raise UserError("set config.trainer.init_from_hf or config.trainer.load_checkpoint_path, "
                    "not both")
  if run.trainer.profiler and run.trainer.profiler_start_step > run.trainer.num_train_steps:
    raise UserError(f"config.trainer.profiler_start_step ({run.trainer.profiler_start_step}) is "
                    f"after the last step, config.trainer.num_train_steps "
                    f"({run.trainer.num_train_steps})")
  if run.trainer.batch_size != "auto" and run.trainer.batch_size % run.trainer.gradient_accumulation_steps:
    raise UserError(f"config.trainer.batch_size ({run.trainer.batch_size}) must be divisible by "
                    f"config.trainer.gradient_accumulation_steps "
                    f"({run.trainer.gradient_accumulation_steps})")
  _check_optimizer(run.optimizer)
  if run.trainer.nan_policy not in ("halt", "skip"):
    raise UserError(f"config.trainer.nan_policy must be 'halt' or 'skip'; got {run.trainer.nan_policy!r}")
  if run.data.on_corrupt_record not in ("fail", "skip"):
    raise UserError(f"config.data.on_corrupt_record must be 'fail' or 'skip'; "
                    f"got {run.data.on_corrupt_record!r}")
  if run.data.mixture and run.data.dataset != "stdlib":
    raise UserError("set config.data.dataset or config.data.mixture, not both")
  return run


# Model keys that mean the same in every family (see model_config): how the model computes, not
# what. model_like carries them over with the shape.
COMPUTE_KEYS = ("remat", "dtype", "param_dtype", "attention_impl", "scan_layers",
                "cross_entropy_block_size")


def model_like(model: ml_collections.ConfigDict, architecture: str,
               **values) -> ml_collections.ConfigDict:
  """model_config(architecture, **values), with `model`'s shape (the keys the family requires:
  vocab_size, seq_len, layers, heads, widths) and COMPUTE_KEYS where `values` does not say.

  Any other key is the family's default, not `model`'s (rope_theta, sliding_window): one family's
  run with another's model, e.g. configs/mixtral.py:8x7b, configs/mistral.py:7b's run.
  """
  family = models.FAMILIES.get(architecture)  # None: model_config names the unknown family.
  shape = [f.name for f in dataclasses.fields(family.config)
           if f.default is dataclasses.MISSING] if family else []
  kept = {key: model[key] for key in (*shape, *COMPUTE_KEYS) if key in model}
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


def _shown(file: str | pathlib.Path) -> pathlib.Path:
  """A config file's path for a message: relative to the working directory when inside it, as
  --config most often names it (a module's __file__ is absolute)."""
  path = pathlib.Path(file)
  return path.relative_to(pathlib.Path.cwd()) if path.is_relative_to(pathlib.Path.cwd()) else path


def run_name(config_argument: str) -> str:
  """The default workdir's name for --config=FILE[:VARIANT]: FILE's stem, then _VARIANT
  (configs/gpt2.py:nano -> gpt2_nano, as configs/gpt2_nano.py)."""
  path, *variant = config_argument.split(":", 1)
  return "_".join([pathlib.Path(path).stem, *variant])
