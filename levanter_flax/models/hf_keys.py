"""Reading a Hugging Face config.json's keys: positive numbers, and values we must match.

A missing required key raises KeyError, which hf.read_config names with the file.
"""
import math
from typing import Any

from levanter_flax.core.errors import UserError

REQUIRED = object()


def _positive(hf: dict, key: str, default: Any, where: str, integer: bool) -> Any:
  """hf[key], checked positive; `default` where it is absent or null, and without one a KeyError
  (`where` prefixes nested keys: "rope_parameters.")."""
  value = hf.get(key)
  if value is None:
    if default is REQUIRED:
      raise KeyError(f"{where}{key}")
    return default
  kinds, kind = (int, "integer") if integer else ((int, float), "number")
  if isinstance(value, bool) or not isinstance(value, kinds) or not 0 < value < math.inf:
    raise UserError(f"{where}{key} must be a positive {kind}, got {value!r}")
  return value if integer else float(value)


def integer(hf: dict, key: str, default: Any = REQUIRED, where: str = "") -> int:
  return _positive(hf, key, default, where, integer=True)


def number(hf: dict, key: str, default: Any = REQUIRED, where: str = "") -> float:
  return _positive(hf, key, default, where, integer=False)


def boolean(hf: dict, key: str, default: bool) -> bool:
  """hf[key], true or false; `default` where it is absent."""
  value = hf.get(key, default)
  if not isinstance(value, bool):
    raise UserError(f"{key} must be true or false, got {value!r}")
  return value


def refuse_unless(hf: dict, family: str, expected: dict[str, Any]) -> None:
  """Each key, when present, must hold the one value we compute (absent means that value)."""
  for key, fine in expected.items():
    value = hf.get(key, fine)
    if value != fine or type(value) is not type(fine):  # pylint: disable=unidiomatic-typecheck
      raise UserError(f"{family} config {key}={value!r} is not supported (only {fine!r})")
