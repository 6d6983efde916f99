"""GRPO as a run's objective (config.rl): the reward rises, one device and eight sample and
train alike, a kill -9 mid-rollout or mid-update resumes to the params of an uninterrupted run,
and each bad setting is one line."""
import json
import os
import shutil
import signal
import sys

import jax
import numpy as np
import pytest

import forkserver
import levanter_flax as lf
from conftest import REPO, read_metrics, xla_flags
from levanter_flax.config import to_run_config
from levanter_flax.core.errors import UserError
from levanter_flax.monitoring import report
from levanter_flax.training.loop import train_and_evaluate
from test_main import NANO

STEPS = 24


def ascii_share(completions, **_):
  """The share of a completion's characters that are ASCII: about half of a random byte-level
  model's, and as much as it learns."""
  return [sum(ord(c) < 128 for c in text) / max(len(text), 1) for text in completions]


def write_prompts(directory) -> str:
  path = directory / "prompts.jsonl"
  path.write_text("".join(json.dumps({"prompt": f"say {i}:"}) + "\n" for i in range(40)))
  return str(path)


def grpo_flags(tmp_path, steps: int = STEPS, *extra: str) -> list[str]:
  """A tiny byte-level GPT-2 from scratch, rewarded for ASCII."""
  return [f"--config={NANO}", "--config.model.seq_len=24", "--config.model.num_layers=2",
          "--config.model.hidden_dim=64", f"--config.rl.prompts={write_prompts(tmp_path)}",
          "--config.rl.rewards=test_grpo_train:ascii_share", "--config.rl.group_size=4",
          "--config.rl.max_completion_tokens=8", "--config.trainer.batch_size=16",
          f"--config.trainer.num_train_steps={steps}", "--config.trainer.log_every_steps=1",
          "--config.checkpoint.every_steps=2", "--config.optimizer.learning_rate=1e-2",
          "--config.optimizer.warmup_steps=2", *extra]


def grpo_config(tiny_config, tmp_path, steps: int = STEPS):
  config = tiny_config
  config.model.seq_len = 24
  config.rl.prompts = write_prompts(tmp_path)
  config.rl.rewards = "test_grpo_train:ascii_share"
  config.rl.group_size = 4
  config.rl.max_completion_tokens = 8
  config.trainer.batch_size = 16
  config.trainer.num_train_steps = steps
  config.checkpoint.every_steps = 2
  config.optimizer.learning_rate = 1e-2
  config.optimizer.warmup_steps = 2
  return config


def main(workdir, flags, devices: int = 8, script: str = "", **env):
  """levanter_flax.main (or `script`) on `devices` fake CPU devices, the tests' rewards
  importable."""
  command = [str(REPO / "tests" / script)] if script else ["-m", "levanter_flax.main"]
  return forkserver.run(
      [sys.executable, *command, *flags, f"--workdir={workdir}"], cwd=REPO, capture_output=True,
      text=True, timeout=300,
      env={**os.environ, **env, "PYTHONPATH": str(REPO / "tests"),
           "XLA_FLAGS": xla_flags(devices)})


def rl_metrics(workdir) -> dict[int, dict]:
  return {m["step"]: m for m in read_metrics(workdir) if "rl/reward_mean" in m}


@pytest.mark.slow
def test_grpo_raises_the_reward_and_logs_its_parts(tiny_config, tmp_path):
  train_and_evaluate(to_run_config(grpo_config(tiny_config, tmp_path)), tmp_path / "run")
  logged = rl_metrics(tmp_path / "run")
  assert sorted(logged) == list(range(1, STEPS + 1))  # updates_per_batch 1: a rollout a step.
  rewards = [logged[s]["rl/reward_mean"] for s in sorted(logged)]
  assert np.mean(rewards[-6:]) > np.mean(rewards[:6]) + 0.25, rewards
  last = logged[STEPS]
  for name in ("rl/reward_std", "rl/advantage_abs_mean", "rl/completion_length",
               "rl/generation_tokens_per_second", "rl/rollout_seconds", "grpo/clip_region",
               "train/tokens_per_second", "train/data_wait_seconds"):
    assert np.isfinite(last[name]), name
  assert last["rl/prompts"] == STEPS * 4
  report.report([tmp_path / "run"], tmp_path / "plots")
  png = (tmp_path / "plots" / "reward.png").read_bytes()
  assert png.startswith(b"\x89PNG") and len(png) > 10_000


def logged_ascii_share(completions, **_):
  """ascii_share, noting in $REWARD_LOG.<pid> how many completions each call scored."""
  with open(f"{os.environ['REWARD_LOG']}.{os.getpid()}", "a", encoding="utf-8") as log:
    log.write(f"{len(completions)}\n")
  return ascii_share(completions)


def logged_flags(directory) -> list[str]:
  return grpo_flags(directory, 4, "--config.rl.rewards=test_grpo_train:logged_ascii_share")


def reward_logs(prefix) -> list[list[str]]:
  """Each process's log of logged_ascii_share's calls, by pid."""
  return sorted(p.read_text().split() for p in prefix.parent.glob(f"{prefix.name}.*"))


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
  """4 steps on one device, with logged rewards: what 8 devices and 2 processes must equal."""
  directory = tmp_path_factory.mktemp("one_device")
  done = main(directory / "run", logged_flags(directory), devices=1,
              REWARD_LOG=str(directory / "rewards"))
  assert done.returncode == 0, done.stderr[-3000:]
  assert reward_logs(directory / "rewards") == [["16"] * 4]
  return rl_metrics(directory / "run")


def assert_trains_as_one_device(metrics, one_device) -> None:
  for step_num in range(1, 5):
    assert metrics[step_num]["rl/reward_mean"] == pytest.approx(
        one_device[step_num]["rl/reward_mean"], abs=1e-6), step_num
    assert metrics[step_num]["train/loss"] == pytest.approx(one_device[step_num]["train/loss"],
                                                            abs=1e-5), step_num
    assert metrics[step_num]["train/grad_norm"] == pytest.approx(
        one_device[step_num]["train/grad_norm"], rel=1e-4), step_num


@pytest.mark.slow
def test_one_device_and_eight_sample_and_train_alike(one_device, tmp_path):
  eight = main(tmp_path / "eight", logged_flags(tmp_path) + [
      "--config.trainer.device_mesh.data=4", "--config.trainer.device_mesh.model=2"],
      REWARD_LOG=str(tmp_path / "rewards"))
  assert eight.returncode == 0, eight.stderr[-3000:]
  assert_trains_as_one_device(rl_metrics(tmp_path / "eight"), one_device)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """8 steps, 2 updates per generated batch, checkpoints every 2 steps."""
  workdir = tmp_path_factory.mktemp("uninterrupted")
  done = main(workdir / "run", grpo_flags(workdir, 8, "--config.rl.updates_per_batch=2"))
  assert done.returncode == 0, done.stderr[-3000:]
  return workdir / "run"


def final_params(workdir):
  return jax.tree.leaves(lf.load(workdir).params)


@pytest.mark.slow
@pytest.mark.parametrize("kill_at_step", [6, 7])  # Between a generation's updates; in a rollout.
def test_a_kill_mid_update_or_mid_rollout_resumes_to_the_uninterrupted_params(
    uninterrupted, tmp_path, kill_at_step):
  flags = grpo_flags(tmp_path, 8, "--config.rl.updates_per_batch=2")
  killed = main(tmp_path / "run", flags, script="killed_in_step_main.py",
                KILL_AT_STEP=str(kill_at_step))
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
  resumed = main(tmp_path / "run", flags)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  # It restarted from step 4 (6's generation began at 5) or 6, and sampled what was sampled.
  assert rl_metrics(tmp_path / "run")[7]["rl/reward_mean"] == rl_metrics(uninterrupted)[7][
      "rl/reward_mean"]  # The last generation's.
  for got, want in zip(final_params(tmp_path / "run"), final_params(uninterrupted)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("key, value, message", [
    ("rl.group_size", 1, r"config.rl.group_size must be at least 2"),
    ("trainer.batch_size", 24, r"config.trainer.batch_size \(24\) must be a multiple of "
                               r"config.rl.group_size \(16\)"),
    ("rl.prompts", "/nonexistent/prompts.jsonl", r"the prompts file /nonexistent/prompts.jsonl "
                                                 r"does not exist"),
    ("rl.rewards", "no_such_module:f", r"reward 'no_such_module:f': module no_such_module cannot "
                                       r"be imported"),
    ("rl.max_completion_tokens", 20, r"prompts.jsonl line 1: a prompt of 7 tokens leaves no room "
                                     r"for 20 completion tokens"),
    ("trainer.num_train_steps", 5, r"config.trainer.num_train_steps \(5\) must be a multiple of "
                                   r"config.rl.updates_per_batch \(2\)"),
    ("trainer.spike_policy", "rollback", r"config.trainer.spike_policy 'rollback' skips the "
                                         r"batches of datasets"),
])
def test_bad_grpo_settings_are_one_line(tiny_config, tmp_path, key, value, message):
  config = grpo_config(tiny_config, tmp_path)
  config.rl.group_size = 16 if key == "trainer.batch_size" else config.rl.group_size
  config.rl.updates_per_batch = 2
  section, name = key.split(".")
  config[section][name] = value
  with pytest.raises(UserError, match=message):
    train_and_evaluate(to_run_config(config), tmp_path / "run")


@pytest.mark.slow
def test_a_save_due_within_a_generation_is_made_at_its_end(tiny_config, tmp_path):
  """every_steps 3 with 2 updates a batch: step 3's save is made after step 4, where a resume
  samples the next batch; a resume with another updates_per_batch, within its generation, is
  one line."""
  config = grpo_config(tiny_config, tmp_path, 6)
  config.rl.updates_per_batch = 2
  config.checkpoint.every_steps = 3
  train_and_evaluate(to_run_config(config), tmp_path / "run")
  checkpoints = tmp_path / "run" / "checkpoints"
  assert sorted(int(p.name) for p in checkpoints.iterdir()) == [4, 6]
  shutil.rmtree(checkpoints / "6")
  config.rl.updates_per_batch = 3
  config.trainer.num_train_steps = 9
  with pytest.raises(UserError, match=r"^step 5 falls within a generation of "
                                      r"config.rl.updates_per_batch \(3\) steps"):
    train_and_evaluate(to_run_config(config), tmp_path / "run")


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory, data_cache):
  """A run of 4 steps on 4 prompts a step (batch 16, groups of 4), checkpointed at 2 and 4."""
  from conftest import make_tiny_config
  directory = tmp_path_factory.mktemp("four_steps")
  config = grpo_config(make_tiny_config(data_cache), directory, 4)
  train_and_evaluate(to_run_config(config), directory / "run")
  assert rl_metrics(directory / "run")[4]["rl/prompts"] == 16
  return config, directory / "run"


@pytest.mark.parametrize("key, value, prompts_per_step", [
    ("rl.group_size", 8, 2), ("trainer.batch_size", 32, 8), ("rl.group_size", 2, 8)])
def test_a_resume_with_another_batch_or_group_size_goes_on_from_the_prompts_trained(
    four_steps, tmp_path, key, value, prompts_per_step):
  """Step 5 samples the prompts after the 16 trained on, however many a step now takes."""
  config, trained = four_steps
  shutil.copytree(trained, tmp_path / "run")
  config = config.copy_and_resolve_references()
  section, name = key.split(".")
  config[section][name] = value
  config.trainer.num_train_steps = 6
  train_and_evaluate(to_run_config(config), tmp_path / "run")
  logged = rl_metrics(tmp_path / "run")
  assert [logged[s]["rl/prompts"] for s in (5, 6)] == [16 + prompts_per_step,
                                                        16 + 2 * prompts_per_step]


def test_turning_the_kl_on_at_a_resume_is_one_line(four_steps, tmp_path):
  config, trained = four_steps
  shutil.copytree(trained, tmp_path / "run")
  config = config.copy_and_resolve_references()
  config.rl.beta = 0.04
  config.trainer.num_train_steps = 6
  with pytest.raises(UserError, match=r"^config.rl.beta was 0 when the run in .* started, so it "
                                      r"kept no reference model for the KL"):
    train_and_evaluate(to_run_config(config), tmp_path / "run")


@pytest.mark.slow
def test_two_processes_sample_and_score_their_own_rows_and_train_as_one(one_device, tmp_path):
  """2 processes x 2 devices against 1 device: the same rewards and losses; each process sampled
  (on an engine of its own 2 devices) and scored half of every generation's completions."""
  from test_multihost import free_address
  address = free_address()
  env = {**os.environ, "PYTHONPATH": str(REPO / "tests"), "REWARD_LOG": str(tmp_path / "rewards"),
         "XLA_FLAGS": xla_flags(2)}
  processes = [forkserver.Popen(
      [sys.executable, "-m", "levanter_flax.main", *logged_flags(tmp_path),
       f"--workdir={tmp_path / 'two'}",
       f"--config.trainer.distributed.coordinator_address={address}",
       "--config.trainer.distributed.num_processes=2",
       f"--config.trainer.distributed.process_id={i}"], cwd=REPO, env=env,
      stdout=forkserver.subprocess.PIPE, stderr=forkserver.subprocess.PIPE, text=True)
      for i in range(2)]
  stderrs = [process.communicate(timeout=300)[1] for process in processes]
  for process, stderr in zip(processes, stderrs):
    assert process.returncode == 0, stderr[-3000:]
  # Process 0's log (the others log warnings only); the rewards' logs count both.
  assert "This process samples and scores 8 of each generation's 16 completions" in stderrs[0]
  assert_trains_as_one_device(rl_metrics(tmp_path / "two"), one_device)
  assert reward_logs(tmp_path / "rewards") == [["8"] * 4, ["8"] * 4]
