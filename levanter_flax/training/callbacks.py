"""Callbacks of the Python API: user code the training loop calls every N steps.

    lf.train(config, workdir, callbacks=[lf.Callback(every_steps=100, fn=save_samples)])

A callback costs nothing on the steps it is not due: only a due step's metrics are read from
the device, which waits for that step to finish.
"""
import dataclasses
from typing import Any, Callable, Sequence

import jax

from levanter_flax.core.errors import UserError


@dataclasses.dataclass(frozen=True)
class Callback:
  """fn(step, state, metrics) after every `every_steps`-th step (step % every_steps == 0,
  counted from the run's first step, across resumes), after that step's checkpoint and eval.

  `state` is the step's TrainState on the device (state.params, state.model_params). The next
  step reuses its buffers, so copy what you keep (jax.device_get). `metrics` are the step's
  own train/* scalars as floats, with the eval/* (and harness/*) ones on a step that
  evaluated. An exception from fn stops the run. In a run of several processes every process
  calls it: guard what one process should do alone with jax.process_index() == 0.
  """
  every_steps: int
  fn: Callable[[int, Any, dict[str, float]], None]

  def __post_init__(self):
    if isinstance(self.every_steps, bool) or not isinstance(self.every_steps, int) \
        or self.every_steps < 1:
      raise UserError(f"Callback every_steps must be a positive int; got {self.every_steps!r}")
    if not callable(self.fn):
      raise UserError(f"Callback fn must be callable as fn(step, state, metrics); "
                      f"got {self.fn!r}")


class Callbacks:
  """The callbacks of a run, each called on its due steps."""

  def __init__(self, callbacks: Sequence[Callback]):
    if isinstance(callbacks, Callback) or not isinstance(callbacks, (list, tuple)):
      raise UserError(f"callbacks must be a list of levanter_flax.Callback(every_steps, fn); got "
                      f"{callbacks!r}")
    callbacks = list(callbacks)
    for callback in callbacks:
      if not isinstance(callback, Callback):
        raise UserError(f"callbacks must be levanter_flax.Callback(every_steps, fn); got "
                        f"{callback!r}")
    self._callbacks = callbacks

  def after_step(self, step_num: int, state: Any, step_metrics: dict,
                 eval_metrics: dict[str, float]) -> None:
    due = [c for c in self._callbacks if step_num % c.every_steps == 0]
    if not due:
      return  # Not even a look at the device.
    metrics = {name: float(value) for name, value in jax.device_get(step_metrics).items()}
    metrics |= eval_metrics
    for callback in due:
      callback.fn(step_num, state, dict(metrics))
