"""The checks a config dataclass runs on itself in __post_init__, named by config key.

Each section's dataclass lists its own keys' valid values, so a key lives in
one place (its dataclass and default_config()'s comment).
"""
from typing import Any, Callable

from levanter_flax.core.errors import UserError

Range = tuple[Callable[[Any], bool], str]  # A predicate, and the valid values in words.


def at_least(low: float, words: str = "") -> Range:
  return (lambda value: value >= low), f">= {low:g}" + (f" ({words})" if words else "")


def above(low: float) -> Range:
  return (lambda value: value > low), f"> {low:g}"


def unit(low_open: bool = False, high_open: bool = False) -> Range:
  """Within [0, 1], with either end open."""
  valid = lambda value: ((0 < value if low_open else 0 <= value)
                         and (value < 1 if high_open else value <= 1))
  return valid, f"in {'(' if low_open else '['}0, 1{')' if high_open else ']'}"


def positive(config, section: str, names: tuple[str, ...]) -> None:
  for name in names:
    value = getattr(config, name)
    if isinstance(value, int) and not isinstance(value, bool) and value <= 0:
      raise UserError(f"config key config.{section}.{name} must be positive, got {value}")


def ranges(config, section: str, valid_values: dict[str, Range]) -> None:
  for name, (valid, words) in valid_values.items():
    value = getattr(config, name)
    if not valid(value):
      raise UserError(f"config.{section}.{name} must be {words}; got {value}")
