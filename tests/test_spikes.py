"""trainer.spike_policy=skip (spikes.py): which steps are spikes, that a spike updates nothing,
and that the statistics survive a kill -9."""
import json
import os
import signal
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import forkserver
from conftest import REPO, read_metrics
from levanter_flax.optim import spikes
from levanter_flax.training import step
from levanter_flax.generate.trained import run_params
from levanter_flax.config import to_run_config
from levanter_flax.core.errors import UserError
from levanter_flax.training.loop import train_and_evaluate
from levanter_flax.models.gpt2 import GPT2Config, GPT2LMHeadModel
from test_main import NANO, TINY, assert_one_line_error
from test_resume import run_killed_after_checkpoint


def numpy_spikes(losses, grad_norms, window, threshold):
  """The rule, written out: over the last `window` finite steps (once half of them have run),
  a step is a spike if its loss or gradient norm is above mean + threshold * std; it is
  remembered as at most that bound."""
  seen, verdicts = [], []
  for values in zip(losses, grad_norms):
    history = np.asarray(seen[-window:], np.float64).reshape(-1, 2)
    bounds = np.full(2, np.inf)
    if len(history) >= max(2, window // 2):
      bounds = history.mean(axis=0) + threshold * history.std(axis=0)
    verdicts.append(bool(np.any(np.asarray(values) > bounds)))
    if np.all(np.isfinite(values)):
      seen.append(np.minimum(values, bounds))
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_changed_spike_policy_is_refused_on_resume(tiny_config, tmp_path):
  tiny_config.trainer.num_train_steps = 2
  tiny_config.trainer.eval_every_steps = 100
  tiny_config.checkpoint.every_steps = 2
  train_and_evaluate(to_run_config(tiny_config), tmp_path)
  tiny_config.trainer.num_train_steps = 4
  tiny_config.trainer.spike_policy = "skip"
  with pytest.raises(UserError, match=r"trainer.spike_policy"):
    train_and_evaluate(to_run_config(tiny_config), tmp_path)


def test_rollback_counts_the_window_in_step_order():
  watch = spikes.SpikeWatch(window=4, rollback_after=2, recent=((1, 8),))
  for step_num in range(2, 6):
    watch.add(step_num, 8 * step_num, {"train/spike": 0.0})
  watch.flush()  # Step 1's spike left the window at step 5.
  assert watch.recent == ()
  for step_num, flag in ((6, 1.0), (7, 0.0), (8, 0.0), (9, 0.0), (10, 1.0), (11, 1.0), (12, 1.0)):
    watch.add(step_num, 8 * step_num, {"train/spike": flag})
  with pytest.raises(spikes.RollBack) as raised:
    watch.flush()
  assert (raised.value.first_step, raised.value.windows) == (10, (80, 88))


def test_the_steps_a_rollback_trains_again_count_no_spike():
  watch = spikes.SpikeWatch(window=8, rollback_after=2, recent=(), replayed_through=11)
  for step_num in range(9, 14):
    watch.add(step_num, 8 * step_num, {"train/spike": 1.0})
  with pytest.raises(spikes.RollBack) as raised:
    watch.flush()
  assert (raised.value.steps, raised.value.windows, raised.value.at_step) == ((12, 13), (96, 104),
                                                                            13)


# Spikes at steps 9 and 11 (batches ending at windows 72 and 88: 8 per step): read at the step-12
# log, past the step-10 checkpoint, which is set aside; the run goes back to step 8's.
SPIKED_STEPS = (9, 11)
ROLLBACK = ["--config.trainer.num_train_steps=14", "--config.trainer.log_every_steps=4",
            "--config.checkpoint.every_steps=2", "--config.trainer.eval_every_steps=100",
            "--config.trainer.batch_size=8", "--config.data.reader_groups=1",
            "--config.trainer.spike_policy=rollback", "--config.trainer.spike_window=8",
            "--config.trainer.spike_threshold=3", "--config.trainer.spike_rollback_after=2",
            "--config.optimizer.warmup_steps=2"]


def run_spiked(workdir, data_cache, kill_after=None, spike_windows=None, *flags, **env):
  spike_windows = spike_windows or ",".join(str(8 * s) for s in SPIKED_STEPS)
  return forkserver.run(
      [sys.executable, str(REPO / "tests" / "spiked_main.py"), f"--config={NANO}",
       f"--workdir={workdir}", *TINY, *ROLLBACK, f"--config.data.cache_dir={data_cache}", *flags],
      cwd=REPO, capture_output=True, text=True, timeout=300,
      env={**os.environ, "KILL_AFTER_CHECKPOINT": str(kill_after),
           "SPIKE_WINDOWS": spike_windows, **env})


def final_params(workdir):
  return jax.tree.leaves(run_params(workdir)[1])


@pytest.mark.slow
def test_a_rollback_ends_as_a_run_that_never_saw_the_spikes_kill_or_not(data_cache, tmp_path):
  rolled, killed, never = tmp_path / "rolled", tmp_path / "killed", tmp_path / "never"
  result = run_spiked(rolled, data_cache)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "Rolled back: 2 loss spikes from step 9. Checkpoints [10] set aside" in result.stderr
  rollbacks = json.loads((rolled / spikes.ROLLBACKS_FILE).read_text())
  assert rollbacks == [{"first_spike_step": 9, "skipped_windows": [72, 88],
                        "checkpoints_set_aside": [10], "rolled_back_at_step": 11}]
  assert (rolled / "checkpoints" / "10.rolled-back-0").is_dir()
  # The same stream with those batches taken out from the start: the same params, bit for bit.
  never.mkdir()
  (never / spikes.ROLLBACKS_FILE).write_text(json.dumps(
      [{"first_spike_step": 0, "skipped_windows": [72, 88], "checkpoints_set_aside": []}]))
  result = run_spiked(never, data_cache)
  assert result.returncode == 0 and "Rolled back" not in result.stderr
  # Killed after the replay's step-12 checkpoint and resumed: the same again.
  assert run_spiked(killed, data_cache, kill_after=12).returncode == -signal.SIGKILL
  result = run_spiked(killed, data_cache)
  assert result.returncode == 0, result.stderr[-3000:]
  for rolled_leaf, never_leaf, killed_leaf in zip(
      final_params(rolled), final_params(never), final_params(killed)):
    np.testing.assert_array_equal(rolled_leaf, never_leaf)
    np.testing.assert_array_equal(killed_leaf, never_leaf)


@pytest.mark.slow
def test_a_lasting_change_of_level_ends_within_max_rollbacks(data_cache, tmp_path):
  """From step 9 on, every batch is of another level: the replays after each rollback skip and
  learn from it, and the rollbacks stop at max_rollbacks, in one line, or the run trains on."""
  result = run_spiked(tmp_path, data_cache, None, "72-", "--config.trainer.max_rollbacks=2")
  rollbacks = json.loads((tmp_path / spikes.ROLLBACKS_FILE).read_text())
  assert 1 <= len(rollbacks) <= 2
  if result.returncode:
    assert_one_line_error(result, "would roll the run back once more than "
                                  "config.trainer.max_rollbacks (2;")
  # The steps replayed after a rollback count no spike: each rollback is past the last.
  assert all(later["first_spike_step"] > earlier["rolled_back_at_step"]
             for earlier, later in zip(rollbacks, rollbacks[1:]))


@pytest.mark.slow
@pytest.mark.parametrize("term_at", ["rollback", "restart"])
def test_a_stop_asked_for_at_a_rollback_ends_the_run_with_a_checkpoint(data_cache, tmp_path,
                                                                       term_at):
  result = run_spiked(tmp_path, data_cache, TERM_AT=term_at)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "Rolled back: 2 loss spikes from step 9" in result.stderr
  # Back at step 8's checkpoint, the next attempt stops after its first step, and saves it.
  assert max(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == 9


@pytest.mark.parametrize("changes, message", [
    ({"spike_policy": "rollback_all"}, "config.trainer.spike_policy must be one of none, skip, "
                                       "rollback; got 'rollback_all'"),
    ({"spike_policy": "skip", "spike_rollback_after": 2}, "config.trainer.spike_rollback_after is "
     "2, but config.trainer.spike_policy is 'skip', which reads it not: set spike_policy=rollback"),
    ({"spike_policy": "skip", "spike_threshold": 0.0}, "config.trainer.spike_threshold must be > 0"),
    ({"spike_policy": "skip", "spike_window": 2}, "config.trainer.spike_window must be >= 4"),
    ({"spike_policy": "rollback", "max_rollbacks": -1}, "config.trainer.max_rollbacks must be "
                                                       ">= 0"),
    ({"spike_window": 64}, "config.trainer.spike_window is 64, but config.trainer.spike_policy is "
                           "'none', which reads it not"),
])
def test_bad_spike_settings_are_one_line(tiny_config, changes, message):
  for key, value in changes.items():
    setattr(tiny_config.trainer, key, value)
  with pytest.raises(UserError, match=r"^" + message.replace("(", r"\(")) as raised:
    to_run_config(tiny_config)
  assert "\n" not in str(raised.value)
