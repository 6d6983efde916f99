"""LoRA: low-rank adapters on a frozen base model (config.model.lora), computed as peft does.

A targeted projection computes y = x W + b + dropout(x) A B * (alpha / rank), A [in, rank]
drawn as peft draws its lora_A (kaiming-uniform, a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))) and
B [rank, out] zero, so a fresh adapter changes nothing. The adapters are the kernel's siblings,
`<projection>/lora_a` and `<projection>/lora_b`; partitioning.py shards A like the kernel's
input axis and B like its output axis. The families' projections are all `Dense`; Mixtral's
expert weights are not, and cannot be targeted.

The step trains the adapters alone: `split` cuts a model's params into the frozen base and the
adapters, `merged` joins them again for the forward pass. The base model alone (a reference
model, as DPO's) is the family's module for `without_lora(cfg)` applied to the frozen half:
step.objective(models.build(without_lora(cfg)), state.frozen, tokens).
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

ADAPTERS = ("lora_a", "lora_b")
# The attention and MLP projections of every family: GPT-2's c_attn, c_proj (attention's and
# the MLP's) and c_fc; the Llama kind's q/k/v/o_proj and gate/up/down_proj.
DEFAULT_TARGETS = (r"/(attn/(c_attn|c_proj)|mlp/(c_fc|c_proj)|self_attn/(q_proj|k_proj|v_proj|"
                   r"o_proj)|mlp/(gate_proj|up_proj|down_proj))/kernel$")
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
                           "(peft's lora_dropout)", FREE)
  targets: str = setting(
      DEFAULT_TARGETS, "LoRA: a regex searched in each projection kernel's name as the scanned "
      "model names it (layers/self_attn/q_proj/kernel: every layer alike); the default takes the "
      "attention and MLP projections of every family", STATE, convert=_targets)

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


class Dense(nn.Dense):
  """nn.Dense (the same parameters and arithmetic), plus LoRA adapters when config.model.lora
  targets its kernel. Dropout on the adapters' input needs a "dropout" rng: the train step
  gives one, evaluation and sampling none."""
  lora: LoraConfig = LoraConfig()

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
    x, a, b = dtypes.promote_dtype(x, a, b, dtype=self.dtype)
    return y + (x @ a @ b) * jnp.asarray(self.lora.scale, y.dtype)


def is_adapter(path: str) -> bool:
  return path.rsplit("/", 1)[-1] in ADAPTERS


def _paths(tree: dict, prefix: str = ""):
  for name, value in tree.items():
    path = f"{prefix}/{name}" if prefix else name
    if isinstance(value, dict) or hasattr(value, "items"):
      yield from _paths(value, path)
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
  items = list(_paths(params))
  return (_tree((p, v) for p, v in items if not is_adapter(p)),
          _tree((p, v) for p, v in items if is_adapter(p)))


def merged(base: Optional[dict], adapters: dict) -> dict:
  """The model's params from split's halves; the adapters alone when there is no base."""
  if base is None:
    return adapters
  return _tree(list(_paths(base)) + list(_paths(adapters)))


def check_targets(cfg, params: dict) -> None:
  """A LoRA model with no adapter is a mistake in config.model.lora.targets: said in one line,
  with some of the names it could have matched."""
  if not cfg.lora.rank or any(is_adapter(p) for p, _ in _paths(params)):
    return
  kernels = [_LAYER_INDEX.sub(r"\1/", p) for p, _ in _paths(params) if p.endswith("/kernel")]
  names = list(dict.fromkeys(kernels))[:6]
  raise UserError(f"config.model.lora.targets {cfg.lora.targets!r} matches no projection of "
                  f"this {cfg.architecture} model; its projection kernels are named e.g. "
                  f"{', '.join(names)}")


def merge_into_base(cfg, params: dict) -> tuple[Any, dict]:
  """(the config without LoRA, each targeted kernel W + A B * alpha / rank) on the host, in
  float32: the plain model that computes what the LoRA model does (a scanned stack alike)."""
  base, adapters = split(params)
  flat = dict(_paths(base))
  for module, (a, b) in adapters_of(adapters).items():
    kernel = np.asarray(flat[f"{module}/kernel"], np.float32)
    low_rank = np.matmul(np.asarray(a, np.float32), np.asarray(b, np.float32))
    flat[f"{module}/kernel"] = kernel + low_rank * np.float32(cfg.lora.scale)
  return without_lora(cfg), _tree(flat.items())


def without_lora(cfg) -> Any:
  return dataclasses.replace(cfg, lora=LoraConfig())


def adapters_of(params: dict) -> dict[str, tuple[Any, Any]]:
  """module path (the kernel's name less /kernel) -> (A, B)."""
  flat = dict(_paths(params))
  return {p[:-len("/lora_a")]: (flat[p], flat[p[:-len("/lora_a")] + "/lora_b"])
          for p in flat if p.endswith("/lora_a")}
