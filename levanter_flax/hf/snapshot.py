"""Hugging Face checkpoints (config.json + safetensors) to and from levanter_flax parameters.

Each family's HFLayout (models/<family>.py) names its HF architecture, translates
its config.json and names each tensor (and whether it is transposed); this
module reads and writes the files. HF names each layer's tensors: a scanned
model's stacked layers (models.unstack_layers) are cut into them on export, and
stacked from them (models.stack_layers) on import. A config value that would
change the logits and that we do not compute is refused by key, never ignored;
so are tensors that are not floating point (quantized checkpoints). float32,
float16 and bfloat16 tensors load, in one file or in shards named by
model.safetensors.index.json (a hub cache's snapshot, whose files are symlinks
into its blobs/, too); an export is written in any of the three, sharded as
transformers shards, with the token ids that generation needs.
"""
import dataclasses
import functools
import json
import os
from typing import Any

import numpy as np
from etils import epath

from levanter_flax import models
from levanter_flax.core import paths, progress, schema
from levanter_flax.core.errors import UserError
from levanter_flax.models import common

# HF architecture name -> our family.
SUPPORTED = {family.hf.architecture: family for family in models.FAMILIES.values()}


def read_config(directory: epath.Path) -> Any:
  """Our model config for an HF checkpoint directory's config.json."""
  path = directory / "config.json"
  try:
    hf = json.loads(path.read_text())
  except (OSError, ValueError) as e:
    raise UserError(f"cannot read {path}: {e}") from None
  if not isinstance(hf, dict) or not isinstance(hf.get("architectures") or [], list):
    raise UserError(f"{path} is not a Hugging Face config: expected an object with a list "
                    f"'architectures'")
  architecture = (hf.get("architectures") or [None])[0]
  if not isinstance(architecture, str) or architecture not in SUPPORTED:
    raise UserError(f"{path}: architecture {architecture!r} is not supported; "
                    f"supported: {', '.join(SUPPORTED)}")
  try:
    return SUPPORTED[architecture].hf.config_from_hf(hf)
  except KeyError as e:
    raise UserError(f"{path} lacks {e.args[0]!r} for {architecture}") from None
  except UserError as e:
    raise UserError(f"{path}: {e}") from None


# The safetensors dtypes of weights. Anything else (integers, float8) holds quantized or
# non-weight data that a cast would silently corrupt.
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


def _tensor_index(file: epath.Path, shown: epath.Path) -> dict[str, tuple[int, ...]]:
  """name -> shape of the tensors in a safetensors file, read from its header alone.

  safetensors checks the header against the file's size, so a truncated
  download or a file that is no safetensors at all is named here, as `shown`.
  """
  from safetensors import SafetensorError, safe_open  # pylint: disable=g-import-not-at-top
  try:
    with safe_open(str(file), framework="flax") as f:
      return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
  except SafetensorError as e:
    raise UserError(f"{shown} is truncated or not a safetensors file: {e}") from None
  except OSError as e:
    raise UserError(f"cannot read {shown}: {e.strerror or e}") from None


def _read_tensor(file: epath.Path, name: str, shown: epath.Path) -> np.ndarray:
  """One tensor as float32 (bfloat16 included, which numpy alone cannot read)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top
  with safe_open(str(file), framework="flax") as f:
    dtype = f.get_slice(name).get_dtype()
    if dtype not in _FLOAT_DTYPES:
      raise UserError(f"{shown}: tensor {name} has dtype {dtype}; only floating point "
                      f"({', '.join(_FLOAT_DTYPES)}) is supported, not quantized checkpoints")
    return np.asarray(f.get_tensor(name).astype(jnp.float32))


INDEX = "model.safetensors.index.json"


def _weight_files(directory: epath.Path) -> list[str]:
  """The names of the safetensors files that hold the weights: the ones the index names
  (transformers' sharded checkpoints), else every *.safetensors in the directory."""
  if not (directory / INDEX).exists():
    names = sorted(file.name for file in directory.glob("*.safetensors"))
    if not names:
      raise UserError(f"{directory} holds no *.safetensors file")
    return names
  try:
    weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
    names = sorted(set(weight_map.values()))
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    raise UserError(f"cannot read {directory / INDEX}: expected an object with a 'weight_map' "
                    f"of tensor -> file ({type(e).__name__}: {e})") from None
  for name in names:
    if not isinstance(name, str) or "/" in name or not (directory / name).exists():
      raise UserError(f"{directory / INDEX} names the file {name!r}, which is not in {directory}")
  return names


def load(directory: epath.Path, scan_layers: bool = False) -> tuple[Any, dict]:
  """(model config, params) of an HF checkpoint directory, as float32 numpy arrays; with
  scan_layers, laid out as the scanned model's."""
  cfg = read_config(directory)
  names = _weight_files(directory)
  with paths.local_copy(directory, "*.safetensors") as local:  # safetensors maps real files.
    params = _params(cfg, directory, [local / name for name in names])
  if not scan_layers:
    return cfg, params
  cfg = common.with_compute(cfg, scan_layers=True)
  return cfg, models.stack_layers(cfg, params)


def _params(cfg: Any, directory: epath.Path, files: list[epath.Path]) -> dict:
  index = {}  # name -> (file, shape)
  for file in files:
    for name, shape in _tensor_index(file, directory / file.name).items():
      if name in index:  # A stale shard next to a newer checkpoint: which one is meant?
        raise UserError(f"tensor {name} is in both {directory / index[name][0].name} and "
                        f"{directory / file.name}")
      index[name] = (file, shape)
  expected = _expected_shapes(cfg)
  params = {}
  for ours, (theirs, transposed) in models.family(cfg).hf.tensor_names(cfg).items():
    if isinstance(theirs, str):
      value = _tensor(index, theirs, transposed, expected[ours], directory)
    else:  # One tensor per expert, stacked on a leading axis.
      value = np.stack([_tensor(index, name, transposed, expected[ours][1:], directory)
                        for name in theirs])
    _set(params, ours, value)
  return params


def _tensor(index: dict, theirs: str, transposed: bool, expected: tuple[int, ...],
            directory: epath.Path) -> np.ndarray:
  """HF tensor `theirs` in our layout, checked to have the `expected` shape."""
  # A bare GPT2Model checkpoint has no "transformer." prefix.
  name = theirs if theirs in index else theirs.removeprefix("transformer.")
  if name not in index:
    raise UserError(f"{directory}: tensor {theirs} is missing")
  file, shape = index[name]
  if (shape[::-1] if transposed else shape) != expected:
    raise UserError(f"{directory}: tensor {theirs} has shape {shape}, expected "
                    f"{expected[::-1] if transposed else expected} for this config")
  value = _read_tensor(file, name, directory / file.name)
  return np.ascontiguousarray(value.T) if transposed else value


# What an export's weights may be stored as: the floating point types transformers and we load.
DTYPES = ("bfloat16", "float16", "float32")


def numpy_dtype(name: str) -> np.dtype:
  """One of DTYPES as numpy stores it (bfloat16 through ml_dtypes, as jax does)."""
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  return np.dtype({"bfloat16": ml_dtypes.bfloat16, "float16": np.float16,
                   "float32": np.float32}[name])


def save(cfg: Any, params: dict, directory: epath.Path, *, dtype: str = "float32",
         max_shard_size: int = 5 * 10**9, token_ids: dict[str, Any] | None = None,
         files: dict[str, bytes] | None = None) -> None:
  """Writes what transformers' from_pretrained reads: config.json, generation_config.json and
  the weights, cast to `dtype`, in model.safetensors or, over max_shard_size bytes, in shards
  and their index (as save_pretrained shards). params in cfg's layout, scanned or not.

  token_ids: eos_token_id, bos_token_id, pad_token_id (those known), for both configs;
  generation stops at the EOS only if it is named. files: more files (name -> contents) to write
  beside them, e.g. the tokenizer's.
  """
  from safetensors import SafetensorError  # pylint: disable=g-import-not-at-top
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  stored = numpy_dtype(dtype)
  if cfg.compute.scan_layers:
    params = models.unstack_layers(cfg, params)
  paths.make_dirs(directory, "output directory")
  tensors = {}
  for ours, (theirs, transposed) in models.family(cfg).hf.tensor_names(cfg).items():
    value = np.asarray(_get(params, ours)).astype(stored)
    for name, part in ([(theirs, value)] if isinstance(theirs, str) else zip(theirs, value)):
      tensors[name] = np.ascontiguousarray(part.T if transposed else part)
  shards = _shards(tensors, max_shard_size)
  token_ids = {k: v for k, v in (token_ids or {}).items() if v is not None}
  # transformers 5 reads "dtype", earlier ones "torch_dtype": the dtype a model loads in.
  config = {**models.family(cfg).hf.config_to_hf(cfg), **token_ids, "dtype": dtype,
            "torch_dtype": dtype}
  contents = {"config.json": _json(config), "generation_config.json": _json(token_ids),
              **(files or {})}
  if len(shards) > 1:
    contents[INDEX] = _json({"metadata": {"total_size": sum(x.nbytes for x in tensors.values())},
                          "weight_map": {name: file for file, shard in shards.items()
                                         for name in sorted(shard)}})
  try:
    with paths.staged(directory) as local, progress.Progress(
        f"export {directory}", total=len(shards), unit="files", counters=("MB",)) as shown:
      for file, shard in shards.items():
        save_file(shard, str(local / file), metadata={"format": "pt"})
        shown.advance(1, MB=sum(x.nbytes for x in shard.values()) / 1e6)
      for name, data in contents.items():
        (local / name).write_bytes(data)
      for name in [*shards, *contents]:
        # save_file creates its file 0600; a checkpoint is for others to read (and serve).
        os.chmod(local / name, 0o644)
  except (OSError, SafetensorError) as e:  # The latter wraps I/O errors, e.g. a full disk.
    raise UserError(f"cannot write the checkpoint into {directory}: "
                    f"{getattr(e, 'strerror', None) or e}") from None


def _shards(tensors: dict[str, np.ndarray], max_shard_size: int) -> dict[str, dict]:
  """File name -> tensors: in order, a new shard whenever the next tensor would take this one
  over max_shard_size bytes (a larger tensor is a shard of its own), named as transformers
  names them; one shard is model.safetensors."""
  shards, size = [{}], 0
  for name, value in tensors.items():
    if shards[-1] and size + value.nbytes > max_shard_size:
      shards, size = shards + [{}], 0
    shards[-1][name], size = value, size + value.nbytes
  if len(shards) == 1:
    return {"model.safetensors": shards[0]}
  return {f"model-{i:05d}-of-{len(shards):05d}.safetensors": shard
          for i, shard in enumerate(shards, 1)}


def _json(value: dict) -> bytes:
  return (json.dumps(value, indent=2) + "\n").encode()


def _expected_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
  """Our path -> shape in the unrolled layout, the one tensor_names names: traced as
  models.init_params initialises, with XLA's attention whatever the host's kernel (a TPU's
  'auto', splash, refuses a sequence shorter than its blocks)."""
  import jax  # pylint: disable=g-import-not-at-top
  unrolled = common.with_compute(cfg, scan_layers=False)
  shapes = jax.eval_shape(functools.partial(models.init_params, unrolled), jax.random.key(0))
  return {"/".join(k.key for k in path): x.shape
          for path, x in jax.tree_util.tree_flatten_with_path(shapes)[0]}


def _set(tree: dict, path: str, value) -> None:
  *parents, leaf = path.split("/")
  for part in parents:
    tree = tree.setdefault(part, {})
  tree[leaf] = value


def _get(tree: dict, path: str):
  for part in path.split("/"):
    tree = tree[part]
  return tree


# The model's sections that are the run's whatever the checkpoint: how it computes (the weights
# are laid out and cast for it) and its LoRA adapters.
RUN_SECTIONS = ("compute", "lora")


def decided_by_checkpoint(cfg: Any) -> list[str]:
  """The model settings of cfg's family that an HF checkpoint decides, dotted below
  config.model (num_layers, moe.num_experts): those that shape the weights or change what they
  compute (schema.STATE or MODEL). The rest are the run's: RUN_SECTIONS, and seq_len where no
  weight depends on it (RoPE; GPT-2's position table makes it a shape)."""
  decided = []
  for field in dataclasses.fields(cfg):
    if schema.is_section(field):
      if field.name not in RUN_SECTIONS:
        decided += [f"{field.name}.{name}"
                    for name in decided_by_checkpoint(getattr(cfg, field.name))]
    elif field.metadata.get("kind") in (schema.STATE, schema.MODEL):
      decided.append(field.name)
  return decided


def setting_of(cfg: Any, name: str) -> Any:
  """The value of a dotted setting name (decided_by_checkpoint's) in a model config; None where
  the family has no such setting."""
  for part in name.split("."):
    cfg = getattr(cfg, part, None)
  return cfg


def with_settings(cfg: Any, values: dict[str, Any]) -> Any:
  """cfg with dotted settings (decided_by_checkpoint's) replaced, nested sections alike."""
  nested: dict[str, dict[str, Any]] = {}
  top = {}
  for name, value in values.items():
    section, _, rest = name.partition(".")
    if rest:
      nested.setdefault(section, {})[rest] = value
    else:
      top[name] = value
  top |= {section: with_settings(getattr(cfg, section), inner) for section, inner in nested.items()}
  return dataclasses.replace(cfg, **top)


def differences(hf_cfg: Any, run_cfg: Any) -> list[str]:
  """'model.num_layers 12 (checkpoint) != 24 (config)' for each setting the checkpoint decides
  (decided_by_checkpoint) in either config."""
  names = list(dict.fromkeys(name for cfg in (hf_cfg, run_cfg)
                             for name in decided_by_checkpoint(cfg)))
  return [f"model.{name} {setting_of(hf_cfg, name)} (checkpoint) != "
          f"{setting_of(run_cfg, name)} (config)" for name in names
          if setting_of(hf_cfg, name) != setting_of(run_cfg, name)]
