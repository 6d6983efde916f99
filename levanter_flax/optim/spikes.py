"""Loss spikes (config.trainer.spike_policy): a step whose loss or gradient norm stands out of
the recent ones updates nothing; under rollback, several such steps close together send the run
back to its newest checkpoint from before them, never to train on their batches again.

`skip_spikes` wraps the optimizer, as Levanter's skip-step does: the rolling statistics are
part of the optimizer state, so they live on the device, are checkpointed with it (a resume
keeps them), and never make the loop wait for a step. A step is a spike when its loss or its
gradient norm (before clipping) exceeds the mean of the last `window` steps' by more than
`threshold` of their standard deviations. Until half the window has been seen, nothing is a
spike: the first steps' fast-falling loss has no stable band yet. A spike enters the window
at the band's edge (winsorized): a lasting change of level (a new data mixture) raises the band
step by step rather than being skipped forever, while one huge spike does not widen it enough
to hide the next. Non-finite steps are the nan_policy's, and stay out of it.

Rollback (`SpikeWatch`, `RollBack`, `roll_back`) is the host's part. The loop reads each step's
spike flag at its boundaries (log, checkpoint, eval), as it reads the non-finite flags, so no
step waits; it counts the spikes of the last spike_window steps, in step order, and at the step
where they reach spike_rollback_after it raises RollBack. The run then sets aside its
checkpoints from the first of those spikes on, records the spikes' batches in
<workdir>/spike_rollbacks.json, and starts again as a resume does: from the newest checkpoint
left, skipping those batches wherever the stream reaches them (a restart reads the file too).
The steps it trains again, up to the one that rolled back, count no spike towards another
rollback: their spikes are skipped and enter the band at its edge, so a lasting change of level
(new data, another learning rate) raises the band there instead of rolling back without end.
trainer.max_rollbacks bounds the rollbacks of a run; one more ends it in one line.
A batch is known by its stream position (the reader groups' window count once it is read),
which the data order fixes. Everything is decided from the step's replicated metrics and the
checkpointed count of recent spikes, so every process, and a run killed and resumed anywhere,
decides alike.
"""
import dataclasses
import json
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from levanter_flax.core import paths
from levanter_flax.core.errors import UserError

POLICIES = ("none", "skip", "rollback")
ROLLBACKS_FILE = "spike_rollbacks.json"


class SpikeState(NamedTuple):
  inner: Any  # The wrapped optimizer's state.
  losses: jax.Array  # [window]: a ring of the latest finite steps' losses...
  grad_norms: jax.Array  # ... and gradient norms.
  seen: jax.Array  # How many of the ring's entries hold a step (at most window).
  next_slot: jax.Array  # Where the next step goes.
  skipped: jax.Array  # Spikes skipped since the run began.


def spike_bounds(state: SpikeState, threshold: float) -> tuple[jax.Array, jax.Array]:
  """(loss, gradient norm) above which a step is a spike: the window's mean plus `threshold`
  deviations; +inf until half the window has run."""
  window = state.losses.shape[0]
  held = jnp.arange(window) < state.seen
  count = jnp.maximum(state.seen, 1)

  def bound(history):
    mean = jnp.where(held, history, 0).sum() / count
    deviation = jnp.sqrt(jnp.where(held, (history - mean) ** 2, 0).sum() / count)
    return jnp.where(state.seen >= max(2, window // 2), mean + threshold * deviation, jnp.inf)
  return bound(state.losses), bound(state.grad_norms)


def skip_spikes(inner: optax.GradientTransformation, window: int,
                threshold: float) -> optax.GradientTransformationExtraArgs:
  """`inner`, except that a spike's update is zero and leaves `inner`'s state as it was. Its
  update takes the step's loss as loss= (a missing one is an error)."""
  inner = optax.with_extra_args_support(inner)

  def init(params):
    return SpikeState(inner.init(params), jnp.zeros([window], jnp.float32),
                      jnp.zeros([window], jnp.float32), jnp.zeros([], jnp.int32),
                      jnp.zeros([], jnp.int32), jnp.zeros([], jnp.int32))

  def update(grads, state: SpikeState, params=None, *, loss, **extra_args):
    grad_norm = optax.tree.norm(grads)
    loss_bound, grad_norm_bound = spike_bounds(state, threshold)
    spike = (loss > loss_bound) | (grad_norm > grad_norm_bound)
    updates, inner_state = inner.update(grads, state.inner, params, **extra_args)
    updates = jax.tree.map(lambda u: jnp.where(spike, jnp.zeros_like(u), u), updates)
    inner_state = jax.tree.map(lambda new, old: jnp.where(spike, old, new), inner_state,
                               state.inner)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    slot = state.next_slot
    # At most the bound: one huge spike would widen the band enough to hide the next ones.
    record = lambda ring, value, bound: jnp.where(
        finite, ring.at[slot].set(jnp.minimum(value, bound)), ring)
    return updates, SpikeState(
        inner_state, record(state.losses, loss, loss_bound),
        record(state.grad_norms, grad_norm, grad_norm_bound),
        jnp.where(finite, jnp.minimum(state.seen + 1, window), state.seen),
        jnp.where(finite, (slot + 1) % window, slot),
        state.skipped + (spike & finite).astype(jnp.int32))

  return optax.GradientTransformationExtraArgs(init, update)


def skipped_spikes(opt_state: Any) -> jax.Array | None:
  """How many spikes a run skipped, from its optimizer state; None without skip_spikes."""
  return opt_state.skipped if isinstance(opt_state, SpikeState) else None


class RollBack(Exception):
  """Raised by the loop at step `at_step`: go back to before the first of the spikes at `steps`,
  without their batches (at stream positions `windows`)."""

  def __init__(self, steps: tuple[int, ...], windows: tuple[int, ...], at_step: int):
    super().__init__(f"{len(windows)} loss spikes from step {steps[0]}")
    self.steps, self.windows, self.at_step = steps, windows, at_step

  @property
  def first_step(self) -> int:
    return self.steps[0]


class SpikeWatch:
  """spike_policy=rollback's count of the spikes of the last `window` steps (see the module's
  docstring). `recent` is the count a checkpoint saved: (step, windows) of each spike; the spikes
  of steps up to `replayed_through`, trained again after a rollback, are not counted."""

  def __init__(self, window: int, rollback_after: int, recent: tuple[tuple[int, int], ...],
               replayed_through: int = 0):
    self._window, self._rollback_after = window, rollback_after
    self._replayed_through = replayed_through
    self.recent, self._pending = tuple(recent), []

  def add(self, step_num: int, windows: int, step_metrics: dict) -> None:
    self._pending.append((step_num, windows, step_metrics["train/spike"]))

  def flush(self) -> None:
    """Reads the flags of the steps since the last flush, in order; raises RollBack at the
    step whose spike makes spike_rollback_after within the window."""
    pending, self._pending = self._pending, []
    flags = jax.device_get([flag for _, _, flag in pending])
    for (step_num, windows, _), flag in zip(pending, flags):
      counted = float(flag) and step_num > self._replayed_through
      recent = self.recent + (((step_num, windows),) if counted else ())
      self.recent = tuple((s, w) for s, w in recent if s > step_num - self._window)
      if len(self.recent) >= self._rollback_after:
        raise RollBack(tuple(s for s, _ in self.recent), tuple(w for _, w in self.recent),
                       step_num)


@dataclasses.dataclass(frozen=True)
class Rollbacks:
  """What <workdir>/spike_rollbacks.json says of a run's earlier rollbacks."""
  entries: tuple[dict, ...] = ()

  @classmethod
  def read(cls, workdir: epath.Path) -> "Rollbacks":
    path = workdir / ROLLBACKS_FILE
    if not path.exists():
      return cls()
    try:
      rollbacks = cls(tuple(json.loads(path.read_text())))
      rollbacks.skipped_windows()
      rollbacks.replayed_through()
      return rollbacks
    except (ValueError, TypeError, KeyError, AttributeError) as e:
      raise UserError(f"{path} is damaged ({e}): it lists the batches rolled-back loss spikes "
                      f"came from; restore it, or start a new run") from None

  def skipped_windows(self) -> frozenset[int]:
    """The batches (by stream position) that the rollbacks took out of this run."""
    return frozenset(int(w) for entry in self.entries for w in entry["skipped_windows"])

  def replayed_through(self) -> int:
    """The last step trained again after a rollback (0: none); files from before it was
    recorded say nothing of it."""
    return max((int(entry.get("rolled_back_at_step", 0)) for entry in self.entries), default=0)


def roll_back(workdir: epath.Path, rollback: RollBack, checkpoints: epath.Path,
              max_rollbacks: int) -> None:
  """Sets aside the checkpoints from rollback.first_step on, then records its batches: a kill
  between the two replays the spikes and rolls back again, to the same end. Past
  `max_rollbacks`, a UserError instead, and nothing is changed."""
  earlier = list(Rollbacks.read(workdir).entries)
  if len(earlier) >= max_rollbacks:
    before = ", ".join(str(entry["first_spike_step"]) for entry in earlier) or "none"
    raise UserError(
        f"loss spikes at steps {', '.join(map(str, rollback.steps))} would roll the run back "
        f"once more than config.trainer.max_rollbacks ({max_rollbacks}; earlier rollbacks from "
        f"steps: {before}, in {workdir / ROLLBACKS_FILE}): the loss level may have changed for "
        f"good. Raise max_rollbacks, or set spike_policy=skip to train on while the band adapts")
  newer = sorted(int(p.name) for p in checkpoints.glob("*")
                 if p.name.isdigit() and int(p.name) >= rollback.first_step)
  if jax.process_index() == 0:  # Every process decided alike; one writes.
    for step in newer:
      paths.move_tree(checkpoints / str(step), checkpoints / f"{step}.rolled-back-{len(earlier)}")
    entry = {"first_spike_step": rollback.first_step, "skipped_windows": list(rollback.windows),
             "checkpoints_set_aside": newer, "rolled_back_at_step": rollback.at_step}
    paths.write_atomically(workdir / ROLLBACKS_FILE, json.dumps(earlier + [entry], indent=1))
  multihost_utils.sync_global_devices("levanter_flax: spike rollback recorded")
  logging.warning("Rolled back: %s. Checkpoints %s set aside; restarting from the newest before "
                  "step %d, without those batches (%s)", rollback, newer or "(none)",
                  rollback.first_step, workdir / ROLLBACKS_FILE)
