"""`python -m levanter_flax.main` that kills itself (SIGKILL) at GRPO's step $KILL_AT_STEP: in the
middle of its rollout (the completions sampled, not yet a batch) if the step generates, else
between the updates of one generation."""
import os
import runpy
import signal

from levanter_flax.training import rollouts

_next, _sample = rollouts.RolloutBatches.next, rollouts.sample


def _sample_then_die(*args, **kwargs):
  _sample(*args, **kwargs)
  os.kill(os.getpid(), signal.SIGKILL)


def _next_or_die(self, step_num, state):
  if str(step_num) == os.environ.get("KILL_AT_STEP"):
    rollouts.sample = _sample_then_die
    _next(self, step_num, state)
    os.kill(os.getpid(), signal.SIGKILL)
  return _next(self, step_num, state)


rollouts.RolloutBatches.next = _next_or_die
runpy.run_module("levanter_flax.main", run_name="__main__", alter_sys=True)
