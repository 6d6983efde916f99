"""Hugging Face checkpoints (config.json + safetensors) to and from levanter_flax parameters.

GPT-2 (GPT2LMHeadModel) and Llama (LlamaForCausalLM). GPT-2's Conv1D weights
are stored [in, out] like our kernels; Llama's Linear weights are [out, in]
and are transposed. RoPE needs no permutation: HF's Llama layout is the
half-split one that models/llama.py uses.
"""
import json
import pathlib
from typing import Any, Callable

import numpy as np

from levanter_flax import models
from levanter_flax.errors import UserError
from levanter_flax.models.gpt2 import GPT2Config
from levanter_flax.models.llama import LlamaConfig

SUPPORTED = {"GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama"}


def _gpt2_config(hf: dict) -> GPT2Config:
  if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
    raise UserError(f"GPT-2 activation_function {hf['activation_function']!r} is not supported "
                    f"(only the tanh GELU, gelu_new)")
  return GPT2Config(vocab_size=hf["vocab_size"], seq_len=hf["n_positions"], num_layers=hf["n_layer"],
                    num_heads=hf["n_head"], hidden_dim=hf["n_embd"],
                    layer_norm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
                    initializer_range=hf.get("initializer_range", 0.02))


def _llama_config(hf: dict) -> LlamaConfig:
  for key, fine in (("tie_word_embeddings", False), ("attention_bias", False), ("mlp_bias", False),
                    ("rope_scaling", None)):
    if hf.get(key, fine) != fine:
      raise UserError(f"Llama config {key}={hf[key]!r} is not supported (only {fine!r})")
  heads = hf["num_attention_heads"]
  if hf.get("head_dim", hf["hidden_size"] // heads) * heads != hf["hidden_size"]:
    raise UserError(f"Llama head_dim {hf['head_dim']} x {heads} heads != hidden_size "
                    f"{hf['hidden_size']}: not supported")
  rope = hf.get("rope_parameters") or {}
  return LlamaConfig(vocab_size=hf["vocab_size"], seq_len=hf["max_position_embeddings"],
                     num_layers=hf["num_hidden_layers"], num_heads=heads,
                     num_kv_heads=hf.get("num_key_value_heads", heads),
                     hidden_dim=hf["hidden_size"], intermediate_dim=hf["intermediate_size"],
                     rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
                     rms_norm_epsilon=hf.get("rms_norm_eps", 1e-6),
                     initializer_range=hf.get("initializer_range", 0.02))


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
  return {ours: (theirs, False) for ours, theirs in names.items()}


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


def read_config(directory: pathlib.Path) -> Any:
  """Our model config for an HF checkpoint directory's config.json."""
  try:
    hf = json.loads((directory / "config.json").read_text())
  except (OSError, ValueError) as e:
    raise UserError(f"cannot read {directory / 'config.json'}: {e}") from None
  architecture = (hf.get("architectures") or [None])[0]
  if architecture not in SUPPORTED:
    raise UserError(f"{directory / 'config.json'}: architecture {architecture!r} is not supported; "
                    f"supported: {', '.join(SUPPORTED)}")
  try:
    return _FAMILIES[SUPPORTED[architecture]][0](hf)
  except KeyError as e:
    raise UserError(f"{directory / 'config.json'} lacks {e.args[0]!r} for {architecture}") from None


def load(directory: str | pathlib.Path) -> tuple[Any, dict]:
  """(model config, params) of an HF checkpoint directory, as float32 numpy arrays."""
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  directory = pathlib.Path(directory).expanduser()
  cfg = read_config(directory)
  files = sorted(directory.glob("*.safetensors"))
  if not files:
    raise UserError(f"{directory} holds no *.safetensors file")
  tensors = {}
  for file in files:
    tensors |= load_file(str(file))
  expected = _expected_shapes(cfg)
  params = {}
  for ours, (theirs, transposed) in _FAMILIES[cfg.architecture][1](cfg).items():
    # A bare GPT2Model checkpoint has no "transformer." prefix.
    tensor = tensors.get(theirs, tensors.get(theirs.removeprefix("transformer.")))
    if tensor is None:
      raise UserError(f"{directory}: tensor {theirs} is missing")
    value = tensor.T if transposed else tensor
    if value.shape != expected[ours]:
      raise UserError(f"{directory}: tensor {theirs} has shape {tuple(tensor.shape)}, expected "
                      f"{expected[ours][::-1] if transposed else expected[ours]} for this config")
    _set(params, ours, np.asarray(value, np.float32))
  return cfg, params


def save(cfg: Any, params: dict, directory: str | pathlib.Path) -> None:
  """Writes config.json and model.safetensors that transformers' from_pretrained reads."""
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  if cfg.scan_layers:
    raise UserError("export of scan_layers models is not supported yet; train with "
                    "config.model.scan_layers=False")
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  tensors = {}
  for ours, (theirs, transposed) in _FAMILIES[cfg.architecture][1](cfg).items():
    value = np.asarray(_get(params, ours), np.float32)
    tensors[theirs] = np.ascontiguousarray(value.T if transposed else value)
  save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
  (directory / "config.json").write_text(json.dumps(_hf_config(cfg), indent=2))


def _hf_config(cfg: Any) -> dict:
  if cfg.architecture == "gpt2":
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": cfg.vocab_size, "n_positions": cfg.seq_len, "n_embd": cfg.hidden_dim,
            "n_layer": cfg.num_layers, "n_head": cfg.num_heads,
            "layer_norm_epsilon": cfg.layer_norm_epsilon, "activation_function": "gelu_new",
            "initializer_range": cfg.initializer_range, "tie_word_embeddings": True,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
  return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
          "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.seq_len,
          "hidden_size": cfg.hidden_dim, "intermediate_size": cfg.intermediate_dim,
          "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
          "num_key_value_heads": cfg.num_kv_heads, "rms_norm_eps": cfg.rms_norm_epsilon,
          "rope_theta": cfg.rope_theta, "hidden_act": "silu", "tie_word_embeddings": False,
          "attention_bias": False, "mlp_bias": False, "initializer_range": cfg.initializer_range}


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
            "intermediate_dim", "rope_theta", "rms_norm_epsilon", "layer_norm_epsilon")
  return [f"model.{f} {getattr(hf_cfg, f, None)} (checkpoint) != {getattr(run_cfg, f, None)} (config)"
          for f in fields if getattr(hf_cfg, f, None) != getattr(run_cfg, f, None)]

