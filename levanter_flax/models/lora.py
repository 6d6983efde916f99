"""LoRA: low-rank adapters on a frozen base model (config.model.lora), computed as peft does.

A targeted projection computes y = x W + b + dropout(x) A B * (alpha / rank), A [in, rank]
drawn as peft draws its lora_A (kaiming-uniform, a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))) and
B [rank, out] zero, so a fresh adapter changes nothing. The adapters are the kernel's siblings,
`<projection>/lora_a` and `<projection>/lora_b`; partitioning.py shards A like the kernel's
input axis and B like its output axis. A mixture's expert stacks ([experts, in, out], no Dense)
get one adapter per expert, `<stack>_lora_a` [experts, in, rank] and `<stack>_lora_b`
[experts, rank, out], added to the stack as W + A B * (alpha / rank) before the grouped matmul,
as peft's target_parameters does: so their input can have no dropout.

The step trains the adapters alone: `split` cuts a model's params into the frozen base and the
adapters, `merged` joins them again for the forward pass. The base model alone (a reference
model, as DPO's) is the family's module for `without_lora(cfg)` applied to the frozen half:
step.loss_and_parts(models.build(without_lora(cfg)), state.frozen, batch).
"""
import dataclasses
import re
from typing import Any, Optional

import flax.linen as nn
from flax.linen import dtypes
import jax
import jax.numpy as jnp
import numpy as np

from levanter_flax.core.errors import UserError
from levanter_flax.core.schema import FREE, MODEL, STATE, setting
from levanter_flax.models.common import cast_in_layer

ADAPTERS = ("lora_a", "lora_b")
# The attention and MLP projections of every family: GPT-2's c_attn, c_proj (attention's and
# the MLP's) and c_fc; the Llama kind's q/k/v/o_proj and gate/up/down_proj. Not a mixture's
# expert stacks (EXPERT_TARGETS): a saved run's targets are part of its state, and a default
# that grew would refuse to resume every run saved under the old one.
DEFAULT_TARGETS = (r"/(attn/(c_attn|c_proj)|mlp/(c_fc|c_proj)|self_attn/(q_proj|k_proj|v_proj|"
                   r"o_proj)|mlp/(gate_proj|up_proj|down_proj))/kernel$")
# What to add for a mixture's expert stacks (not its router, mlp/gate).
EXPERT_TARGETS = r"/mlp/experts/(gate_proj|up_proj|down_proj)$"
# An unrolled block's name, h_3, as the scanned model names every block: h.
_LAYER_INDEX = re.compile(r"^([^/]+)_\d+/")


def _targets(key: str, value: Any) -> str:
  if not isinstance(value, str):
    raise UserError(f"config key {key} must be a regex string; got {value!r}")
  try:
    re.compile(value)
  except re.error as e:
    raise UserError(f"config key {key}: {value!r} is not a valid regex: {e}") from None
  return value


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Low-rank adapters on a frozen base (config.model.lora)."""
  rank: int = setting(0, "LoRA: train rank-r adapters on the targeted projections and freeze "
                      "the rest; 0: off (every parameter trains)", STATE)
  alpha: float = setting(8.0, "LoRA: the adapters' output is scaled by alpha / rank (peft's "
                         "lora_alpha)", MODEL)
  dropout: float = setting(0.0, "LoRA: dropout on the adapters' input, in training only "
                           "(peft's lora_dropout); not with expert stacks targeted", FREE)
  targets: str = setting(
      DEFAULT_TARGETS, "LoRA: a regex searched in each projection kernel's name as the scanned "
      "model names it (layers/self_attn/q_proj/kernel: every layer alike; an expert stack: "
      "layers/mlp/experts/gate_proj); the default takes the attention and MLP projections of "
      "every family, not a mixture's experts (append |/mlp/experts/(gate_proj|up_proj|"
      "down_proj)$ for those)", STATE, convert=_targets)

  def __post_init__(self):
    if self.rank < 0:
      raise UserError(f"config.model.lora.rank must be >= 0 (0: off); got {self.rank}")
    if self.rank and not self.alpha > 0:
      raise UserError(f"config.model.lora.alpha must be positive; got {self.alpha}")
    if not 0 <= self.dropout < 1:
      raise UserError(f"config.model.lora.dropout must be in [0, 1); got {self.dropout}")

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


def lora_section() -> Any:
  """The `lora` field every family's config declares, keyword-only like `compute`."""
  return setting(LoraConfig(), "LoRA adapters on a frozen base model", kw_only=True)


def targeted(lora: LoraConfig, kernel_name: str) -> bool:
  """Whether the kernel named `kernel_name` (scanned or unrolled) gets adapters."""
  return bool(lora.rank) and bool(re.search(lora.targets, _LAYER_INDEX.sub(r"\1/", kernel_name)))


def _promote_in_layer(*arrays, dtype=None, inexact: bool = True) -> list:
  """flax's promote_dtype, whose casts to a given dtype stay in a scanned layer's loop
  (common.cast_in_layer)."""
  if dtype is None:
    return dtypes.promote_dtype(*arrays, inexact=inexact)
  return [None if a is None else cast_in_layer(jnp.asarray(a), dtype) for a in arrays]


class Dense(nn.Dense):
  """nn.Dense (the same parameters and arithmetic), plus LoRA adapters when config.model.lora
  targets its kernel. Dropout on the adapters' input needs a "dropout" rng: the train step
  gives one, evaluation and sampling none."""
  lora: LoraConfig = LoraConfig()
  promote_dtype: Any = _promote_in_layer

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    y = super().__call__(x)
    if not targeted(self.lora, "/".join(self.scope.path) + "/kernel"):
      return y
    rank = self.lora.rank
    # peft's kaiming_uniform_(a=sqrt(5)) of lora_A [rank, in]: U(-1/sqrt(in), 1/sqrt(in)).
    a = self.param("lora_a", nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform"),
                   (x.shape[-1], rank), self.param_dtype)
    b = self.param("lora_b", nn.initializers.zeros, (rank, self.features), self.param_dtype)
    if self.lora.dropout and self.has_rng("dropout"):
      keep = jax.random.bernoulli(self.make_rng("dropout"), 1 - self.lora.dropout, x.shape)
      x = jnp.where(keep, x / (1 - self.lora.dropout), 0).astype(x.dtype)
    x, a, b = self.promote_dtype(x, a, b, dtype=self.dtype)
    return y + (x @ a @ b) * jnp.asarray(self.lora.scale, y.dtype)


def effective_kernel(dense: Dense) -> jax.Array:
  """A bound Dense's kernel with its adapters' A B * alpha / rank added, if it has them: for a
  layer that multiplies by the kernel itself (DeepSeek's absorbed attention)."""
  params = dense.variables["params"]
  kernel = params["kernel"]
  if "lora_a" not in params:
    return kernel
  return kernel + params["lora_a"] @ params["lora_b"] * jnp.asarray(dense.lora.scale,
                                                                     kernel.dtype)


def with_stack_adapters(module: nn.Module, lora: LoraConfig, name: str,
                        stack: jax.Array) -> jax.Array:
  """An expert stack [experts, in, out], the param `name` of `module`, plus its experts'
  adapters' A B * alpha / rank when config.model.lora targets it: peft's target_parameters
  (ParamWrapper), which keeps no dropout for the same reason."""
  if not targeted(lora, "/".join(module.scope.path + (name,))):
    return stack
  if lora.dropout:
    raise UserError(f"config.model.lora.dropout must be 0 when config.model.lora.targets takes "
                    f"expert stacks ({name}): their adapters are added to each expert's weights, "
                    f"whose input dropout cannot reach (as peft's target_parameters); got "
                    f"{lora.dropout}")
  experts, fan_in, fan_out = stack.shape
  # peft's kaiming-uniform per expert: each [in, rank] drawn as a Dense adapter's.
  a = module.param(f"{name}_lora_a", nn.initializers.variance_scaling(
      1 / 3, "fan_in", "uniform", batch_axis=(0,)), (experts, fan_in, lora.rank), stack.dtype)
  b = module.param(f"{name}_lora_b", nn.initializers.zeros, (experts, lora.rank, fan_out),
                   stack.dtype)
  return stack + jnp.einsum("eir,ero->eio", a, b) * jnp.asarray(lora.scale, stack.dtype)


def is_adapter(path: str) -> bool:
  name = path.rsplit("/", 1)[-1]
  return any(name == adapter or name.endswith("_" + adapter) for adapter in ADAPTERS)


def paths(tree: dict, prefix: str = ""):
  """("a/b/kernel", leaf) for each leaf of a nested dict."""
  for name, value in tree.items():
    path = f"{prefix}/{name}" if prefix else name
    if isinstance(value, dict) or hasattr(value, "items"):
      yield from paths(value, path)
    else:
      yield path, value


def _tree(items) -> dict:
  tree = {}
  for path, value in items:
    *parents, leaf = path.split("/")
    node = tree
    for part in parents:
      node = node.setdefault(part, {})
    node[leaf] = value
  return tree


def split(params: dict) -> tuple[dict, dict]:
  """(the frozen base, the adapters) of a LoRA model's params: two trees of its leaves."""
  items = list(paths(params))
  return (_tree((p, v) for p, v in items if not is_adapter(p)),
          _tree((p, v) for p, v in items if is_adapter(p)))


def merged(base: Optional[dict], adapters: dict) -> dict:
  """The model's params from split's halves; the adapters alone when there is no base."""
  if base is None:
    return adapters
  return _tree(list(paths(base)) + list(paths(adapters)))


def check_targets(cfg, params: dict) -> None:
  """A LoRA model with no adapter is a mistake in config.model.lora.targets: said in one line,
  with some of the names it could have matched."""
  if not cfg.lora.rank or any(is_adapter(p) for p, _ in paths(params)):
    return
  kernels = [_LAYER_INDEX.sub(r"\1/", p) for p, _ in paths(params)
             if p.endswith("/kernel") or "/experts/" in p]
  names = list(dict.fromkeys(kernels))[:6]
  raise UserError(f"config.model.lora.targets {cfg.lora.targets!r} matches no projection of "
                  f"this {cfg.architecture} model; its projection kernels are named e.g. "
                  f"{', '.join(names)}")


def merge_into_base(cfg, params: dict) -> tuple[Any, dict]:
  """(the config without LoRA, each targeted kernel W + A B * alpha / rank) on the host, in
  float32: the plain model that computes what the LoRA model does (a scanned stack alike)."""
  base, adapters = split(params)
  flat = dict(paths(base))
  for weight, (a, b) in adapters_of(adapters).items():  # An expert stack's: a matmul per expert.
    low_rank = np.matmul(np.asarray(a, np.float32), np.asarray(b, np.float32))
    flat[weight] = np.asarray(flat[weight], np.float32) + low_rank * np.float32(cfg.lora.scale)
  return without_lora(cfg), _tree(flat.items())


def without_lora(cfg) -> Any:
  return dataclasses.replace(cfg, lora=LoraConfig())


def adapters_of(params: dict) -> dict[str, tuple[Any, Any]]:
  """The adapted weight's path (a kernel's, or an expert stack's) -> (its A, its B)."""
  flat = dict(paths(params))
  adapted = {}
  for path in flat:
    for separator, weight_of in (("/", lambda stem: f"{stem}/kernel"), ("_", lambda stem: stem)):
      if path.endswith(separator + "lora_a"):
        stem = path[:-len(separator + "lora_a")]
        adapted[weight_of(stem)] = (flat[path], flat[f"{stem}{separator}lora_b"])
  return adapted
