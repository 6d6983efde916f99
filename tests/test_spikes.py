"""trainer.spike_policy=skip (spikes.py): which steps are spikes, that a spike updates nothing,
and that the statistics survive a kill -9."""
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import read_metrics
from levanter_flax import spikes, step
from levanter_flax.checkpoint import run_params
from levanter_flax.config import to_run_config
from levanter_flax.errors import UserError
from levanter_flax.loop import train_and_evaluate
from levanter_flax.models.gpt2 import GPT2Config, GPT2LMHeadModel
from test_resume import run_killed_after_checkpoint


def numpy_spikes(losses, grad_norms, window, threshold):
  """The rule, written out: over the last `window` finite steps (once half of them have run),
  a step is a spike if its loss or gradient norm is above mean + threshold * std."""
  seen, verdicts = [], []
  for loss, norm in zip(losses, grad_norms):
    history = np.asarray(seen[-window:], np.float64).reshape(-1, 2)
    spike = False
    if len(history) >= max(2, window // 2):
      mean, std = history.mean(axis=0), history.std(axis=0)
      spike = bool(loss > mean[0] + threshold * std[0] or norm > mean[1] + threshold * std[1])
    verdicts.append(spike)
    if np.isfinite(loss) and np.isfinite(norm):
      seen.append((loss, norm))
  return verdicts


def test_spikes_are_the_numpy_rules_and_update_nothing():
  rng = np.random.default_rng(0)
  window, threshold, steps = 10, 4.0, 40
  losses = 3 + 0.1 * rng.standard_normal(steps)
  norms = 1 + 0.1 * rng.standard_normal(steps)
  losses[[12, 25]] += 2.0  # Loss spikes,
  norms[[18, 30]] *= 4  # gradient-norm spikes,
  losses[22] = np.nan  # and a non-finite step, which stays out of the window.
  params = {"w": jnp.ones(3)}
  optimizer = spikes.skip_spikes(optax.adam(0.1), window, threshold)
  state = optimizer.init(params)
  skipped = []
  for loss, norm in zip(losses, norms):
    grads = {"w": jnp.full(3, norm / np.sqrt(3), jnp.float32)}  # Its norm is `norm`.
    updates, new_state = optimizer.update(grads, state, params, loss=jnp.float32(loss))
    spike = int(new_state.skipped) > int(state.skipped)
    if spike:
      assert not np.any(np.asarray(updates["w"]))
      for new, old in zip(jax.tree.leaves(new_state.inner), jax.tree.leaves(state.inner)):
        np.testing.assert_array_equal(new, old)
    skipped.append(spike)
    state = new_state
  expected = numpy_spikes(losses.astype(np.float32), norms.astype(np.float32), window, threshold)
  assert skipped == [s and np.isfinite(l) for s, l in zip(expected, losses)]
  assert [i for i, s in enumerate(skipped) if s] == [12, 18, 25, 30]


def test_a_window_of_other_data_is_skipped_by_the_train_step():
  """A model learning one token pattern meets a batch of random tokens (its loss jumps): that
  step updates nothing, the next one trains again."""
  cfg = GPT2Config(vocab_size=128, seq_len=32, num_layers=1, num_heads=2, hidden_dim=32)
  model = GPT2LMHeadModel(cfg)
  pattern = jnp.tile(jnp.arange(8), (8, cfg.seq_len // 8))
  params = model.init(jax.random.key(0), pattern)["params"]
  optimizer = spikes.skip_spikes(optax.adamw(3e-2), window=8, threshold=6.0)
  train_step = jax.jit(step.make_train_step(model, optimizer, lambda _: 3e-2))
  state = step.TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))
  noise = jax.random.randint(jax.random.key(1), pattern.shape, 0, cfg.vocab_size)
  totals = []
  for index in range(14):
    batch = noise if index == 10 else pattern
    before = state
    state, metrics = train_step(state, {"tokens": batch})
    totals.append(int(metrics["train/spike_skipped_steps"]))
    if index == 10:
      for new, old in zip(jax.tree.leaves(state.params), jax.tree.leaves(before.params)):
        np.testing.assert_array_equal(new, old)
  assert totals == [0] * 10 + [1] * 4
  assert not np.array_equal(state.params["wte"]["embedding"], before.params["wte"]["embedding"])


def test_skipped_spikes_and_params_are_bit_identical_across_a_kill(data_cache, tmp_path):
  """A low threshold skips many steps, each decided from the checkpointed window: a run killed
  after its step-4 checkpoint and resumed ends as the uninterrupted run, bit for bit."""
  flags = [f"--config.data.cache_dir={data_cache}", "--config.trainer.batch_size=8",
           "--config.trainer.num_train_steps=8", "--config.trainer.eval_every_steps=100",
           "--config.checkpoint.every_steps=4", "--config.data.reader_groups=1",
           "--config.trainer.spike_policy=skip", "--config.trainer.spike_window=4",
           "--config.trainer.spike_threshold=0.5"]
  whole, killed = tmp_path / "whole", tmp_path / "killed"
  assert run_killed_after_checkpoint(whole, None, *flags).returncode == 0
  assert run_killed_after_checkpoint(killed, 4, *flags).returncode == -signal.SIGKILL
  resumed = run_killed_after_checkpoint(killed, None, *flags)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  totals = [{m["step"]: m["train/spike_skipped_steps"] for m in read_metrics(run)
             if "train/spike_skipped_steps" in m} for run in (whole, killed)]
  assert totals[0] == totals[1] and totals[0][8] >= 1, totals
  _, whole_params, _ = run_params(whole)
  _, resumed_params, _ = run_params(killed)
  for a, b in zip(jax.tree.leaves(whole_params), jax.tree.leaves(resumed_params)):
    np.testing.assert_array_equal(a, b)


def test_a_changed_spike_policy_is_refused_on_resume(tiny_config, tmp_path):
  tiny_config.trainer.num_train_steps = 2
  tiny_config.trainer.eval_every_steps = 100
  tiny_config.checkpoint.every_steps = 2
  train_and_evaluate(to_run_config(tiny_config), tmp_path)
  tiny_config.trainer.num_train_steps = 4
  tiny_config.trainer.spike_policy = "skip"
  with pytest.raises(UserError, match=r"trainer.spike_policy"):
    train_and_evaluate(to_run_config(tiny_config), tmp_path)


@pytest.mark.parametrize("changes, message", [
    ({"spike_policy": "rollback_all"}, "config.trainer.spike_policy must be one of none, skip; "
                                       "got 'rollback_all'"),
    ({"spike_policy": "skip", "spike_threshold": 0.0}, "config.trainer.spike_threshold must be > 0"),
    ({"spike_policy": "skip", "spike_window": 2}, "config.trainer.spike_window must be >= 4"),
    ({"spike_window": 64}, "config.trainer.spike_window is 64, but config.trainer.spike_policy is "
                           "'none', which reads it not"),
])
def test_bad_spike_settings_are_one_line(tiny_config, changes, message):
  for key, value in changes.items():
    setattr(tiny_config.trainer, key, value)
  with pytest.raises(UserError, match=r"^" + message.replace("(", r"\(")) as raised:
    to_run_config(tiny_config)
  assert "\n" not in str(raised.value)
