"""Hugging Face checkpoints (config.json + safetensors) to and from levanter_flax parameters.

GPT-2 (GPT2LMHeadModel, tied or untied head) and Llama (LlamaForCausalLM, with
RoPE scaling "linear" or "llama3"). GPT-2's Conv1D weights are stored [in, out]
like our kernels; Linear weights (Llama's, an untied lm_head) are [out, in] and
are transposed. RoPE needs no permutation: HF's Llama layout is the half-split
one that models/llama.py uses. A config value that would change the logits and
that we do not compute is refused by key, never ignored; so are tensors that are
not floating point (quantized checkpoints). bfloat16 tensors load too.
"""
import json
import math
import os
from typing import Any, Callable

import numpy as np
from etils import epath

from levanter_flax import models, paths
from levanter_flax.errors import UserError
from levanter_flax.models.gpt2 import GPT2Config
from levanter_flax.models.llama import ROPE_TYPES, LlamaConfig

SUPPORTED = {"GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama"}
_REQUIRED = object()


def _positive(hf: dict, key: str, default: Any, where: str, integer: bool) -> Any:
  """hf[key], checked positive; `default` where it is absent or null, and without one a KeyError
  that read_config names (`where` prefixes nested keys: "rope_parameters.")."""
  value = hf.get(key)
  if value is None:
    if default is _REQUIRED:
      raise KeyError(f"{where}{key}")
    return default
  kinds, kind = (int, "integer") if integer else ((int, float), "number")
  if isinstance(value, bool) or not isinstance(value, kinds) or not 0 < value < math.inf:
    raise UserError(f"{where}{key} must be a positive {kind}, got {value!r}")
  return value if integer else float(value)


def _integer(hf: dict, key: str, default: Any = _REQUIRED, where: str = "") -> int:
  return _positive(hf, key, default, where, integer=True)


def _number(hf: dict, key: str, default: Any = _REQUIRED, where: str = "") -> float:
  return _positive(hf, key, default, where, integer=False)


def _refuse_unless(hf: dict, family: str, expected: dict[str, Any]) -> None:
  """Each key, when present, must hold the one value we compute (absent means that value)."""
  for key, fine in expected.items():
    value = hf.get(key, fine)
    if value != fine or type(value) is not type(fine):  # pylint: disable=unidiomatic-typecheck
      raise UserError(f"{family} config {key}={value!r} is not supported (only {fine!r})")


def _gpt2_config(hf: dict) -> GPT2Config:
  if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
    raise UserError(f"GPT-2 activation_function {hf['activation_function']!r} is not supported "
                    f"(only the tanh GELU, gelu_new)")
  # Values that change the logits and that our GPT-2 does not compute. reorder_and_upcast_attn
  # is fine: it only reorders the scaling and runs attention in float32, the same arithmetic.
  _refuse_unless(hf, "GPT-2", {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                              "add_cross_attention": False})
  hidden_dim = _integer(hf, "n_embd")
  if _integer(hf, "n_inner", 4 * hidden_dim) != 4 * hidden_dim:
    raise UserError(f"GPT-2 config n_inner={hf['n_inner']!r} is not supported (only 4 x n_embd, "
                    f"{4 * hidden_dim}, or null)")
  tied = hf.get("tie_word_embeddings", True)
  if not isinstance(tied, bool):
    raise UserError(f"tie_word_embeddings must be true or false, got {tied!r}")
  return GPT2Config(vocab_size=_integer(hf, "vocab_size"), seq_len=_integer(hf, "n_positions"),
                    num_layers=_integer(hf, "n_layer"), num_heads=_integer(hf, "n_head"),
                    hidden_dim=hidden_dim,
                    layer_norm_epsilon=_number(hf, "layer_norm_epsilon", 1e-5),
                    initializer_range=_number(hf, "initializer_range", 0.02),
                    tie_word_embeddings=tied)


def _llama_config(hf: dict) -> LlamaConfig:
  _refuse_unless(hf, "Llama", {"tie_word_embeddings": False, "attention_bias": False,
                               "mlp_bias": False, "hidden_act": "silu"})
  heads, hidden_dim = _integer(hf, "num_attention_heads"), _integer(hf, "hidden_size")
  head_dim = _integer(hf, "head_dim", hidden_dim // heads)
  if head_dim * heads != hidden_dim:
    raise UserError(f"Llama head_dim {head_dim} x {heads} heads != hidden_size {hidden_dim}: "
                    f"not supported")
  seq_len = _integer(hf, "max_position_embeddings")
  return LlamaConfig(vocab_size=_integer(hf, "vocab_size"), seq_len=seq_len,
                     num_layers=_integer(hf, "num_hidden_layers"), num_heads=heads,
                     num_kv_heads=_integer(hf, "num_key_value_heads", heads),
                     hidden_dim=hidden_dim, intermediate_dim=_integer(hf, "intermediate_size"),
                     rms_norm_epsilon=_number(hf, "rms_norm_eps", 1e-6),
                     initializer_range=_number(hf, "initializer_range", 0.02),
                     **_llama_rope(hf, seq_len))


def _llama_rope(hf: dict, seq_len: int) -> dict[str, Any]:
  """LlamaConfig's rope_* fields from rope_parameters (transformers 5) or rope_scaling (4.x).

  Like transformers 5, a non-empty rope_scaling wins over rope_parameters, and a rope_theta
  inside the dictionary over the top-level one.
  """
  key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
  rope = hf.get(key) or {}
  if not isinstance(rope, dict):
    raise UserError(f"{key} must be an object, got {rope!r}")
  where = f"{key}."
  type_key = "rope_type" if "rope_type" in rope or "type" not in rope else "type"  # 4.x: "type".
  rope_type = rope.get(type_key, "default")
  partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor")) or 1.0
  if partial != 1:
    raise UserError(f"Llama config partial_rotary_factor={partial!r} is not supported (only 1.0)")
  theta = _number(rope, "rope_theta", None, where) or _number(hf, "rope_theta", 10000.0)
  if rope_type == "default":
    return {"rope_theta": theta}
  if rope_type not in ROPE_TYPES:
    raise UserError(f"Llama config {where}{type_key}={rope_type!r} is not supported (only "
                    f"{', '.join(ROPE_TYPES)})")
  fields = {"rope_theta": theta, "rope_type": rope_type,
            "rope_factor": _number(rope, "factor", where=where)}
  if rope_type == "llama3":
    # As transformers: a top-level original_max_position_embeddings first, max_position_embeddings
    # last.
    original = _integer(hf, "original_max_position_embeddings", None) or _integer(
        rope, "original_max_position_embeddings", seq_len, where)
    low = _number(rope, "low_freq_factor", where=where)
    high = _number(rope, "high_freq_factor", where=where)
    if low >= high:  # The ramp between them divides by high - low.
      raise UserError(f"{where}low_freq_factor {low} must be below {where}high_freq_factor {high}")
    fields |= {"rope_low_freq_factor": low, "rope_high_freq_factor": high,
               "rope_original_seq_len": original}
  return fields


def _gpt2_names(cfg: GPT2Config) -> dict[str, tuple[str, bool]]:
  """Our parameter path -> (HF tensor name, transposed?)."""
  names = {"wte/embedding": "transformer.wte.weight", "wpe/embedding": "transformer.wpe.weight",
           "ln_f/scale": "transformer.ln_f.weight", "ln_f/bias": "transformer.ln_f.bias"}
  for i in range(cfg.num_layers):
    for ours, theirs in (("ln_1/scale", "ln_1.weight"), ("ln_1/bias", "ln_1.bias"),
                         ("ln_2/scale", "ln_2.weight"), ("ln_2/bias", "ln_2.bias"),
                         ("attn/c_attn/kernel", "attn.c_attn.weight"),
                         ("attn/c_attn/bias", "attn.c_attn.bias"),
                         ("attn/c_proj/kernel", "attn.c_proj.weight"),
                         ("attn/c_proj/bias", "attn.c_proj.bias"),
                         ("mlp/c_fc/kernel", "mlp.c_fc.weight"), ("mlp/c_fc/bias", "mlp.c_fc.bias"),
                         ("mlp/c_proj/kernel", "mlp.c_proj.weight"),
                         ("mlp/c_proj/bias", "mlp.c_proj.bias")):
      names[f"h_{i}/{ours}"] = f"transformer.h.{i}.{theirs}"
  names = {ours: (theirs, False) for ours, theirs in names.items()}
  if not cfg.tie_word_embeddings:  # A Linear, [vocab, hidden]; our Dense kernel is its transpose.
    names["lm_head/kernel"] = ("lm_head.weight", True)
  return names


def _llama_names(cfg: LlamaConfig) -> dict[str, tuple[str, bool]]:
  names = {"embed_tokens/embedding": ("model.embed_tokens.weight", False),
           "norm/scale": ("model.norm.weight", False), "lm_head/kernel": ("lm_head.weight", True)}
  for i in range(cfg.num_layers):
    prefix = f"model.layers.{i}"
    for norm in ("input_layernorm", "post_attention_layernorm"):
      names[f"layers_{i}/{norm}/scale"] = (f"{prefix}.{norm}.weight", False)
    for part in ("q_proj", "k_proj", "v_proj", "o_proj"):
      names[f"layers_{i}/self_attn/{part}/kernel"] = (f"{prefix}.self_attn.{part}.weight", True)
    for part in ("gate_proj", "up_proj", "down_proj"):
      names[f"layers_{i}/mlp/{part}/kernel"] = (f"{prefix}.mlp.{part}.weight", True)
  return names


_FAMILIES: dict[str, tuple[Callable, Callable]] = {
    "gpt2": (_gpt2_config, _gpt2_names), "llama": (_llama_config, _llama_names)}


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
    return _FAMILIES[SUPPORTED[architecture]][0](hf)
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


def load(directory: epath.Path) -> tuple[Any, dict]:
  """(model config, params) of an HF checkpoint directory, as float32 numpy arrays."""
  cfg = read_config(directory)
  if not list(directory.glob("*.safetensors")):
    raise UserError(f"{directory} holds no *.safetensors file")
  with paths.local_copy(directory, "*.safetensors") as local:  # safetensors maps real files.
    return cfg, _params(cfg, directory, local)


def _params(cfg: Any, directory: epath.Path, local: epath.Path) -> dict:
  index = {}  # name -> (file, shape)
  for file in sorted(local.glob("*.safetensors")):
    for name, shape in _tensor_index(file, directory / file.name).items():
      if name in index:  # A stale shard next to a newer checkpoint: which one is meant?
        raise UserError(f"tensor {name} is in both {directory / index[name][0].name} and "
                        f"{directory / file.name}")
      index[name] = (file, shape)
  expected = _expected_shapes(cfg)
  params = {}
  for ours, (theirs, transposed) in _FAMILIES[cfg.architecture][1](cfg).items():
    # A bare GPT2Model checkpoint has no "transformer." prefix.
    name = theirs if theirs in index else theirs.removeprefix("transformer.")
    if name not in index:
      raise UserError(f"{directory}: tensor {theirs} is missing")
    file, shape = index[name]
    if (shape[::-1] if transposed else shape) != expected[ours]:
      raise UserError(f"{directory}: tensor {theirs} has shape {shape}, expected "
                      f"{expected[ours][::-1] if transposed else expected[ours]} for this config")
    value = _read_tensor(file, name, directory / file.name)
    _set(params, ours, np.ascontiguousarray(value.T) if transposed else value)
  return params


def save(cfg: Any, params: dict, directory: epath.Path) -> None:
  """Writes config.json and model.safetensors that transformers' from_pretrained reads."""
  from safetensors import SafetensorError  # pylint: disable=g-import-not-at-top
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  if cfg.scan_layers:
    raise UserError("export of scan_layers models is not supported yet; train with "
                    "config.model.scan_layers=False")
  paths.make_dirs(directory, "output directory")
  tensors = {}
  for ours, (theirs, transposed) in _FAMILIES[cfg.architecture][1](cfg).items():
    value = np.asarray(_get(params, ours), np.float32)
    tensors[theirs] = np.ascontiguousarray(value.T if transposed else value)
  try:
    with paths.staged(directory) as local:
      save_file(tensors, str(local / "model.safetensors"), metadata={"format": "pt"})
      (local / "config.json").write_text(json.dumps(_hf_config(cfg), indent=2))
      for name in ("model.safetensors", "config.json"):
        # save_file creates its file 0600; a checkpoint is for others to read (and serve).
        os.chmod(local / name, 0o644)
  except (OSError, SafetensorError) as e:  # The latter wraps I/O errors, e.g. a full disk.
    raise UserError(f"cannot write the checkpoint into {directory}: "
                    f"{getattr(e, 'strerror', None) or e}") from None


def _hf_config(cfg: Any) -> dict:
  if cfg.architecture == "gpt2":
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": cfg.vocab_size, "n_positions": cfg.seq_len, "n_embd": cfg.hidden_dim,
            "n_layer": cfg.num_layers, "n_head": cfg.num_heads,
            "layer_norm_epsilon": cfg.layer_norm_epsilon, "activation_function": "gelu_new",
            "initializer_range": cfg.initializer_range,
            "tie_word_embeddings": cfg.tie_word_embeddings,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
  return {**_hf_rope(cfg), "architectures": ["LlamaForCausalLM"], "model_type": "llama",
          "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.seq_len,
          "hidden_size": cfg.hidden_dim, "intermediate_size": cfg.intermediate_dim,
          "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
          "num_key_value_heads": cfg.num_kv_heads, "rms_norm_eps": cfg.rms_norm_epsilon,
          "rope_theta": cfg.rope_theta, "hidden_act": "silu", "tie_word_embeddings": False,
          "attention_bias": False, "mlp_bias": False, "initializer_range": cfg.initializer_range}


def _hf_rope(cfg: LlamaConfig) -> dict:
  """The RoPE scaling keys, or none; both spellings, so transformers 4 (rope_scaling) and 5
  (rope_parameters, which it gives rope_scaling precedence over) read the same thing."""
  if cfg.rope_type == "default":
    return {}
  rope = {"rope_type": cfg.rope_type, "factor": cfg.rope_factor}
  if cfg.rope_type == "llama3":
    rope |= {"low_freq_factor": cfg.rope_low_freq_factor,
             "high_freq_factor": cfg.rope_high_freq_factor,
             "original_max_position_embeddings": cfg.rope_original_seq_len}
  return {"rope_scaling": rope, "rope_parameters": {**rope, "rope_theta": cfg.rope_theta}}


def _expected_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  shapes = jax.eval_shape(models.build(cfg).init, jax.random.key(0),
                          jnp.zeros((1, 2), jnp.int32))["params"]
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


def differences(hf_cfg: Any, run_cfg: Any) -> list[str]:
  """'model.num_layers 12 (checkpoint) != 24 (config)' for each field that shapes the weights or
  changes what they compute."""
  fields = ("architecture", "vocab_size", "num_layers", "num_heads", "num_kv_heads", "hidden_dim",
            "intermediate_dim", "tie_word_embeddings", "rope_theta", "rope_type", "rope_factor",
            "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_seq_len",
            "rms_norm_epsilon", "layer_norm_epsilon")
  return [f"model.{f} {getattr(hf_cfg, f, None)} (checkpoint) != "
          f"{getattr(run_cfg, f, None)} (config)" for f in fields if getattr(hf_cfg, f, None) != getattr(run_cfg, f, None)]

