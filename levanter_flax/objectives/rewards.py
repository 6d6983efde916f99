"""Rewards for reinforcement learning: functions named by import path, weighted and summed.

A reward is `module:function` (or `module.function`), called as TRL calls its reward
functions: function(completions=[str], prompts=[str], **fields) -> one number per completion,
where fields are the prompt records' other fields ("answer", ...), one value per completion;
prompts and fields only where the function names them or takes **kwargs. The fields it names
without a default (`Reward.fields`) must be in every record (data/rl_prompts.py checks). Built
in: `exact_match` (the completion, stripped, equals the answer) and `math_answer` (math-verify's
verdict on the answer in the completion).

Everything a reward does wrong ends in one line naming it: it cannot be imported, it
raises, or it returns the wrong count, a non-number or NaN. May import core.
"""
import dataclasses
import importlib
import inspect
import math
import numbers
import threading
from typing import Any, Callable, Sequence

import numpy as np

from levanter_flax.core.errors import UserError

BUILT_IN = "levanter_flax.objectives.rewards"


def exact_match(completions: Sequence[str], answer: Sequence[Any], **_) -> list[float]:
  """1 where the completion, stripped, is the answer (as a string, stripped), else 0."""
  return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answer)]


def math_answer(completions: Sequence[str], answer: Sequence[Any], **_) -> list[float]:
  """1 where math-verify finds the completion's answer equal to the record's (LaTeX or plain:
  "\\frac{1}{2}" equals "0.5"), else 0."""
  try:
    import math_verify  # pylint: disable=import-outside-toplevel  # An extra of its own.
  except ImportError as e:
    raise UserError("the math_answer reward needs math-verify: pip install -e \".[rl]\"") from e
  # Its timeouts are signal.alarm's, which only the main thread may set; elsewhere, none.
  seconds = 5 if threading.current_thread() is threading.main_thread() else None
  parse = lambda text: math_verify.parse(text, parsing_timeout=seconds)
  return [float(math_verify.verify(parse(str(a)), parse(c), timeout_seconds=seconds))
          for c, a in zip(completions, answer)]


@dataclasses.dataclass(frozen=True)
class Reward:
  """A reward function, its weight in the sum, and the record fields it takes."""
  name: str
  function: Callable[..., Any]
  weight: float = 1.0

  @property
  def parameters(self) -> tuple[str, ...]:
    """What the function names besides completions (prompts, record fields): each given
    where there is such a thing."""
    return tuple(p.name for p in inspect.signature(self.function).parameters.values()
                 if p.name != "completions"
                 and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))

  @property
  def fields(self) -> tuple[str, ...]:
    """The record fields the function names without a default: each record must have them."""
    parameters = inspect.signature(self.function).parameters
    return tuple(name for name in self.parameters if name != "prompts"
                 and parameters[name].default is inspect.Parameter.empty)

  @property
  def takes_every_field(self) -> bool:
    return any(p.kind == p.VAR_KEYWORD
               for p in inspect.signature(self.function).parameters.values())


def load(name: str, weight: float = 1.0) -> Reward:
  """The reward `module:function` (a bare name: a built-in one); one line if it cannot be."""
  if ":" in name:
    module_name, _, attribute = name.partition(":")
  elif "." in name:
    module_name, _, attribute = name.rpartition(".")
  else:
    module_name, attribute = BUILT_IN, name
  if not module_name or not attribute:
    raise UserError(f"reward {name!r}: name it module:function")
  try:
    module = importlib.import_module(module_name)
  except Exception as e:  # pylint: disable=broad-except  # Its own import may fail any way.
    raise UserError(f"reward {name!r}: module {module_name} cannot be imported: "
                    f"{type(e).__name__}: {e}") from e
  function = getattr(module, attribute, None)
  if not callable(function):
    raise UserError(f"reward {name!r}: {module_name} has no function {attribute}")
  if not math.isfinite(weight):
    raise UserError(f"reward {name!r}: its weight must be a finite number; got {weight}")
  return Reward(name, function, weight)


def score(rewards: Sequence[Reward], completions: Sequence[str], prompts: Sequence[str],
          fields: dict[str, Sequence[Any]]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
  """(the weighted sum [completions], each reward's own values by name) for the completions,
  each with its prompt and its record's fields (one value per completion)."""
  total = np.zeros(len(completions), np.float64)
  each = {}
  for reward in rewards:
    available = {"prompts": prompts, **fields}
    given = available if reward.takes_every_field else {
        name: available[name] for name in reward.parameters if name in available}
    try:
      values = reward.function(completions=list(completions),
                               **{k: list(v) for k, v in given.items()})
    except UserError:
      raise
    except Exception as e:  # pylint: disable=broad-except  # A user's function, any failure.
      raise UserError(f"reward {reward.name} raised {type(e).__name__}: {e}") from e
    each[reward.name] = _numbers(reward.name, values, len(completions))
    total += reward.weight * each[reward.name]
  return total.astype(np.float32), each


def _numbers(name: str, values: Any, count: int) -> np.ndarray:
  """A reward's values as float64[count]; one line for the wrong count, a non-number or NaN."""
  try:
    values = list(values)
  except TypeError:
    raise UserError(f"reward {name} returned {type(values).__name__}, not one number per "
                    f"completion") from None
  if len(values) != count:
    raise UserError(f"reward {name} returned {len(values)} values for {count} completions")
  for i, value in enumerate(values):
    if not isinstance(value, numbers.Real):  # numpy's floats and ints are; complex is not.
      raise UserError(f"reward {name} returned {value!r} ({type(value).__name__}) for "
                      f"completion {i}: not a number")
    if not math.isfinite(value):
      raise UserError(f"reward {name} returned {value} for completion {i}: rewards must be "
                      f"finite")
  return np.asarray(values, np.float64)
