"""Loss spikes (config.trainer.spike_policy): a step whose loss or gradient norm stands out of
the recent ones updates nothing.

`skip_spikes` wraps the optimizer, as Levanter's skip-step does: the rolling statistics are
part of the optimizer state, so they live on the device, are checkpointed with it (a resume
keeps them), and never make the loop wait for a step. A step is a spike when its loss or its
gradient norm (before clipping) exceeds the mean of the last `window` steps' by more than
`threshold` of their standard deviations. Until half the window has been seen, nothing is a
spike: the first steps' fast-falling loss has no stable band yet. A spike's values enter the
window too, so a lasting change of level (a new data mixture) is learned within a window
rather than skipped forever. Non-finite steps are the nan_policy's, and stay out of it.
"""
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

POLICIES = ("none", "skip")


class SpikeState(NamedTuple):
  inner: Any  # The wrapped optimizer's state.
  losses: jax.Array  # [window]: a ring of the latest finite steps' losses...
  grad_norms: jax.Array  # ... and gradient norms.
  seen: jax.Array  # How many of the ring's entries hold a step (at most window).
  next_slot: jax.Array  # Where the next step goes.
  skipped: jax.Array  # Spikes skipped since the run began.


def is_spike(state: SpikeState, loss: jax.Array, grad_norm: jax.Array,
             threshold: float) -> jax.Array:
  """Whether (loss, grad_norm) exceeds the window's mean by over `threshold` deviations."""
  window = state.losses.shape[0]
  held = jnp.arange(window) < state.seen
  count = jnp.maximum(state.seen, 1)

  def beyond(history, value):
    mean = jnp.where(held, history, 0).sum() / count
    deviation = jnp.sqrt(jnp.where(held, (history - mean) ** 2, 0).sum() / count)
    return value > mean + threshold * deviation
  ready = state.seen >= max(2, window // 2)
  return ready & (beyond(state.losses, loss) | beyond(state.grad_norms, grad_norm))


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
    spike = is_spike(state, loss, grad_norm, threshold)
    updates, inner_state = inner.update(grads, state.inner, params, **extra_args)
    updates = jax.tree.map(lambda u: jnp.where(spike, jnp.zeros_like(u), u), updates)
    inner_state = jax.tree.map(lambda new, old: jnp.where(spike, old, new), inner_state,
                               state.inner)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    slot = state.next_slot
    record = lambda ring, value: jnp.where(finite, ring.at[slot].set(value), ring)
    return updates, SpikeState(
        inner_state, record(state.losses, loss), record(state.grad_norms, grad_norm),
        jnp.where(finite, jnp.minimum(state.seen + 1, window), state.seen),
        jnp.where(finite, (slot + 1) % window, slot),
        state.skipped + (spike & finite).astype(jnp.int32))

  return optax.GradientTransformationExtraArgs(init, update)


def skipped_spikes(opt_state: Any) -> jax.Array | None:
  """How many spikes a run skipped, from its optimizer state; None without skip_spikes."""
  return opt_state.skipped if isinstance(opt_state, SpikeState) else None
