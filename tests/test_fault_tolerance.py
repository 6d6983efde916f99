"""Runs end cleanly on SIGTERM/SIGINT and never apply or save a non-finite update."""
import contextlib
import errno
import logging
import pathlib
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import forkserver
from conftest import (REPO, as_at_checkpoint, make_tiny_config, prepare_texts,
                      random_documents, read_metrics, taken_up, train_losses)
from levanter_flax.checkpoint import preemption
from levanter_flax.monitoring import history
from levanter_flax.checkpoint.store import CheckpointConfig, Checkpointer
from levanter_flax.generate.trained import run_params
from levanter_flax.config import mesh, to_run_config
from levanter_flax.data import eval_set
from levanter_flax.data.manifest import load_manifest
from levanter_flax.core.errors import UserError
from levanter_flax.training.loop import train_and_evaluate
from test_main import NANO, TINY


def diverging(config, policy):
  """A learning rate so large that the second update overflows float32."""
  config.optimizer.learning_rate = 1e38
  config.trainer.nan_policy = policy
  return to_run_config(config)


@pytest.mark.slow
def test_halt_stops_at_the_first_non_finite_step(tiny_config, tmp_path):
  with pytest.raises(UserError, match=r"non-finite loss or gradients at step \d+; stopped "
                                      r"\(config.trainer.nan_policy='halt'\)"):
    train_and_evaluate(diverging(tiny_config, "halt"), tmp_path)


@pytest.mark.slow
def test_skip_drops_non_finite_updates_and_saves_finite_params(tiny_config, tmp_path):
  tiny_config.trainer.max_consecutive_skipped_steps = 100
  final = train_and_evaluate(diverging(tiny_config, "skip"), tmp_path)
  assert final["train/skipped_steps"] > 0
  saved = ocp.StandardCheckpointer().restore((tmp_path / "checkpoints" / "10" / "state").absolute())
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(saved["params"]))


def test_skip_halts_after_too_many_skipped_steps_in_a_row(tiny_config, tmp_path):
  tiny_config.trainer.max_consecutive_skipped_steps = 3
  with pytest.raises(UserError, match=r"non-finite loss or gradients in 4 steps in a row, up to "
                                      r"step \d+: more than config.trainer."
                                      r"max_consecutive_skipped_steps \(3\); stopped"):
    train_and_evaluate(diverging(tiny_config, "skip"), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_finishes_the_step_checkpoints_and_exits_zero(data_cache, tmp_path, signum):
  args = [f"--config={NANO}", f"--workdir={tmp_path}", *TINY, "--config.trainer.batch_size=8",
          "--config.trainer.num_train_steps=100000", "--config.checkpoint.every_steps=1000",
          f"--config.data.cache_dir={data_cache}"]
  process = forkserver.Popen([sys.executable, "-m", "levanter_flax.main", *args], cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 240
  while time.time() < deadline and not ((tmp_path / "metrics.jsonl").exists()
                                        and len(train_losses(tmp_path)) >= 3):
    time.sleep(0.5)
  # Impatient: the signal again and again while it writes its last checkpoint (as a launcher
  # or a scheduler may); the last save is waited for all the same.
  while process.poll() is None:
    process.send_signal(signum)
    time.sleep(0.1)
  _, stderr = process.communicate(timeout=120)
  assert process.returncode == 0, stderr[-3000:]
  stopped_at = max(train_losses(tmp_path))
  assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == [stopped_at]
  assert f"Stopped at step {stopped_at} on request" in stderr
  if signum != signal.SIGTERM:
    return  # The same handler: resuming is shown once.
  # The same command, with an end in sight, continues from there.
  result = forkserver.run([sys.executable, "-m", "levanter_flax.main", *args,
                           f"--config.trainer.num_train_steps={stopped_at + 2}"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert max(train_losses(tmp_path)) == stopped_at + 2
  assert [m["step"] for m in read_metrics(tmp_path) if "train/loss" in m][-2:] == [
      stopped_at + 1, stopped_at + 2]


def test_a_hangup_asks_the_run_to_stop_as_sigterm_does():
  """A closed terminal (or a scheduler) sends SIGHUP, whose default ends a run unsaved; the
  run above shows what a recorded request leads to."""
  reached_the_default = []
  default = signal.signal(signal.SIGHUP, lambda *_: reached_the_default.append(True))
  try:
    with preemption.StopSignal() as stop:
      assert not stop.requested(1)
      signal.raise_signal(signal.SIGHUP)
      assert stop.requested(2) and stop.received == signal.SIGHUP
    assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN  # On its way out: no second one.
  finally:
    signal.signal(signal.SIGHUP, default)
  assert not reached_the_default


def checkpoint_files(workdir: pathlib.Path) -> dict[str, bytes]:
  return {str(p.relative_to(workdir)): p.read_bytes()
          for p in sorted((workdir / "checkpoints").rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_resume_refuses_a_changed_model_or_optimizer_and_allows_safe_changes(two_steps, tiny_config,
                                                                            tmp_path):
  taken_up(two_steps, tmp_path)
  tiny_config.trainer.num_train_steps = 2
  saved = (tmp_path / "config.json").read_text()
  assert '"model.num_layers": 2' in saved
  checkpoints = checkpoint_files(tmp_path)
  tiny_config.model.num_layers = 3
  tiny_config.model.hidden_dim = 128
  with pytest.raises(UserError, match=r"cannot resume .* with a different model or optimizer: "
                                      r"model.hidden_dim 64 -> 128, model.num_layers 2 -> 3"):
    train_and_evaluate(to_run_config(tiny_config), tmp_path)
  tiny_config.model.num_layers = 2
  tiny_config.model.hidden_dim = 64
  # Not damage: even with start_fresh_if_unusable, nothing is set aside or overwritten.
  tiny_config.optimizer.name = "lion"
  tiny_config.checkpoint.start_fresh_if_unusable = True
  with pytest.raises(UserError, match=r"with a different model or optimizer: optimizer.name "
                                      r"adamw -> lion; use a new --workdir"):
    train_and_evaluate(to_run_config(tiny_config), tmp_path)
  assert checkpoint_files(tmp_path) == checkpoints
  assert (tmp_path / "config.json").read_text() == saved
  tiny_config.optimizer.name = "adamw"
  tiny_config.optimizer.learning_rate = 1e-3
  tiny_config.trainer.num_train_steps = 3
  train_and_evaluate(to_run_config(tiny_config), tmp_path)
  assert max(train_losses(tmp_path)) == 3
  assert '"optimizer.learning_rate": 0.001' in (tmp_path / "config.json").read_text()


@pytest.mark.slow
def test_a_state_of_another_shape_is_refused_not_set_aside(tiny_config, tmp_path):
  """A change no config key check knows of: adafactor's state gains a decay with weight_decay."""
  tiny_config.optimizer.name = "adafactor"
  tiny_config.optimizer.weight_decay = 0.0
  tiny_config.trainer.num_train_steps = 2
  tiny_config.checkpoint.start_fresh_if_unusable = True
  train_and_evaluate(to_run_config(tiny_config), tmp_path)
  checkpoints = checkpoint_files(tmp_path)
  tiny_config.optimizer.weight_decay = 0.1
  tiny_config.trainer.num_train_steps = 3
  with pytest.raises(UserError, match=r"checkpoint .*/checkpoints/2 holds another state than this "
                                      r"run builds \(opt_state/.*\); the config changed: "
                                      r"optimizer.weight_decay 0.0 -> 0.1, trainer.num_train_steps "
                                      r"2 -> 3; restore the settings"):
    train_and_evaluate(to_run_config(tiny_config), tmp_path)
  assert checkpoint_files(tmp_path) == checkpoints
  # Without config.json to compare with, the checkpoint itself refuses another dtype.
  (tmp_path / "config.json").unlink()
  tiny_config.checkpoint.resume_without_config = True
  tiny_config.optimizer.weight_decay = 0.0
  tiny_config.model.compute.param_dtype = "bfloat16"
  with pytest.raises(UserError, match=r"holds another state than this run builds \(opt_state/"
                                      r"[^:]*: float32 \([\d, ]*\) in the checkpoint, bfloat16 "):
    train_and_evaluate(to_run_config(tiny_config), tmp_path)
  assert checkpoint_files(tmp_path) == checkpoints


@pytest.mark.slow
def test_a_storage_error_is_named_and_sets_nothing_aside(two_steps, tiny_config, tmp_path,
                                                         monkeypatch):
  taken_up(two_steps, tmp_path)
  checkpoints = checkpoint_files(tmp_path)

  def unavailable(*args, **kwargs):
    raise OSError(errno.EIO, "Input/output error")
  monkeypatch.setattr(ocp.StandardCheckpointHandler, "restore", unavailable)
  tiny_config.trainer.num_train_steps = 3
  tiny_config.checkpoint.start_fresh_if_unusable = True
  with pytest.raises(UserError, match=r"cannot read checkpoint .*/checkpoints/2: Input/output "
                                      r"error; it was left as it is"):
    train_and_evaluate(to_run_config(tiny_config), tmp_path)
  assert checkpoint_files(tmp_path) == checkpoints


def straight_config(data_cache: pathlib.Path):
  """tiny_config at a constant learning rate, so that a run resumed or extended from any of its
  checkpoints is the straight one; a checkpoint after every step."""
  config = make_tiny_config(data_cache)
  config.optimizer.min_learning_rate_ratio = 1.0
  config.checkpoint.every_steps = 1
  config.checkpoint.keep = 10
  return config


@pytest.fixture(scope="module")
def straight_run(data_cache, tmp_path_factory) -> pathlib.Path:
  """straight_config's 10 steps, uninterrupted: what the resumes below are compared with, and,
  cut back to one of its checkpoints (as_at_checkpoint), the stopped runs they take up."""
  workdir = tmp_path_factory.mktemp("straight") / "run"
  train_and_evaluate(to_run_config(straight_config(data_cache)), workdir)
  return workdir


# A failed orbax restore leaves its read coroutines unawaited; Python reports each one.
ignore_abandoned_reads = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def corrupt(checkpoint: pathlib.Path) -> None:
  """Truncates the largest array file, as a disk or copy failure would."""
  largest = max((p for p in checkpoint.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
  largest.write_bytes(largest.read_bytes()[:100])


@pytest.mark.slow
@ignore_abandoned_reads
def test_unreadable_newest_checkpoint_falls_back_to_the_one_before(straight_run, data_cache,
                                                                   tmp_path):
  run = as_at_checkpoint(straight_run, tmp_path / "run", 6)
  checkpoints = run / "checkpoints"
  corrupt(checkpoints / "6")
  (checkpoints / "8.orbax-checkpoint-tmp-1234").mkdir()  # A save killed half-way.
  train_and_evaluate(to_run_config(straight_config(data_cache)), run)
  assert (checkpoints / "6.unreadable").is_dir()
  assert [m["run/started_at_step"] for m in read_metrics(run) if "run/started_at_step" in m] == [0, 5]
  expected, got = train_losses(straight_run), train_losses(run)
  for step in range(6, 11):
    assert got[step] == pytest.approx(expected[step], rel=1e-6), step


@pytest.mark.slow
@ignore_abandoned_reads
def test_no_usable_checkpoint_stops_unless_told_to_start_fresh(tiny_config, tmp_path):
  tiny_config.trainer.num_train_steps = 2
  tiny_config.checkpoint.every_steps = 1
  tiny_config.checkpoint.keep = 2
  train_and_evaluate(to_run_config(tiny_config), tmp_path)
  for step in ("1", "2"):
    corrupt(tmp_path / "checkpoints" / step)
  with pytest.raises(UserError, match=r"the checkpoints \[2, 1\] in .* are all damaged; set "
                                      r"config.checkpoint.start_fresh_if_unusable=True"):
    train_and_evaluate(to_run_config(tiny_config), tmp_path)
  tiny_config.checkpoint.start_fresh_if_unusable = True
  train_and_evaluate(to_run_config(tiny_config), tmp_path)
  assert {p.name for p in (tmp_path / "checkpoints").iterdir()} == {"1.unreadable", "2.unreadable", "1", "2"}
  # The same steps damaged again: set aside under new names, and the run makes progress.
  for step in ("1", "2"):
    corrupt(tmp_path / "checkpoints" / step)
  tiny_config.trainer.num_train_steps = 3
  train_and_evaluate(to_run_config(tiny_config), tmp_path)
  assert {p.name for p in (tmp_path / "checkpoints").iterdir()} == {
      "1.unreadable", "2.unreadable", "1.unreadable.2", "2.unreadable.2", "2", "3"}


@pytest.mark.slow
def test_time_based_checkpoints_replace_each_other_and_periodic_ones_stay(tiny_config, tmp_path):
  tiny_config.checkpoint.every_steps = 4
  tiny_config.checkpoint.every_minutes = 1e-9  # Due after every step.
  tiny_config.checkpoint.keep = 2
  tiny_config.checkpoint.keep_every_steps = 4
  tiny_config.trainer.num_train_steps = 11
  train_and_evaluate(to_run_config(tiny_config), tmp_path)
  # 4 and 8 are kept for good; 11 is the last; the time-based ones (1-3, 5-7, 9-10) are gone.
  assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == [4, 8, 11]


def test_a_temporary_checkpoint_is_known_as_one_after_a_restart(tmp_path):
  cadence = CheckpointConfig(every_steps=10, keep=3)
  state = {"w": np.arange(4.0)}
  with contextlib.closing(Checkpointer(tmp_path, cadence)) as checkpointer:
    checkpointer.save(10, state, {}, "step")
    checkpointer.save(12, state, {}, "time")  # Then the process dies: nothing in memory survives.
  with contextlib.closing(Checkpointer(tmp_path, cadence)) as checkpointer:
    assert checkpointer.due(13) is None and checkpointer.due(20) == "step"
    checkpointer.save(14, state, {}, "step")
  assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [10, 14]


@pytest.mark.slow
@pytest.mark.parametrize("items", ["params", "state"])
def test_a_new_run_starts_from_another_runs_checkpoint(straight_run, data_cache, tmp_path, items):
  config = straight_config(data_cache)
  config.checkpoint.load_path = str(straight_run / "checkpoints" / "5")
  config.checkpoint.load_items = items
  train_and_evaluate(to_run_config(config), tmp_path / "c")
  a, c = train_losses(straight_run), train_losses(tmp_path / "c")
  if items == "state":  # Step, optimizer and data position too: run a's last five steps.
    assert sorted(c) == [6, 7, 8, 9, 10]
    for step in c:
      assert c[step] == pytest.approx(a[step], rel=1e-6), step
  else:  # Trained weights, fresh optimizer, data from the start.
    assert sorted(c) == list(range(1, 11))
    assert c[1] < a[1] - 0.5


def test_a_missing_checkpoint_to_load_is_named(tiny_config, tmp_path):
  tiny_config.checkpoint.load_path = str(tmp_path / "nowhere" / "7")
  with pytest.raises(UserError, match="config.checkpoint.load_path .*nowhere/7 is not a checkpoint"):
    train_and_evaluate(to_run_config(tiny_config), tmp_path / "run")


@pytest.mark.slow
def test_resume_on_another_mesh_reshards_the_checkpoint(straight_run, data_cache, tmp_path):
  config = straight_config(data_cache)
  config.trainer.device_mesh = mesh(data=4, model=2)
  config.sharding.parameter_axis = "data"
  train_and_evaluate(to_run_config(config), as_at_checkpoint(straight_run, tmp_path / "run", 5))
  expected, got = train_losses(straight_run), train_losses(tmp_path / "run")
  for step in range(6, 11):
    assert got[step] == pytest.approx(expected[step], rel=1e-5), step


def test_unwritable_checkpoint_directory_is_named(tiny_config, tmp_path):
  (tmp_path / "checkpoints").write_text("a file where the directory should be")
  with pytest.raises(UserError, match=f"checkpoint directory {tmp_path}/checkpoints is not writable"
                                      f"|cannot create checkpoint directory {tmp_path}/checkpoints"):
    train_and_evaluate(to_run_config(tiny_config), tmp_path)


@pytest.mark.slow
def test_a_failed_save_is_named_and_the_earlier_checkpoints_stay(data_cache, tmp_path):
  """The disk fills mid-run: a file size limit set on the running trainer makes its writes fail."""
  args = [f"--config={NANO}", f"--workdir={tmp_path}", *TINY, "--config.trainer.batch_size=8",
          "--config.trainer.num_train_steps=100000", "--config.checkpoint.every_steps=2",
          f"--config.data.cache_dir={data_cache}"]
  # An ignored SIGXFSZ (inherited: restore_signals=False) turns writes past the limit into
  # EFBIG errors, as ENOSPC would be.
  previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  try:
    process = forkserver.Popen([sys.executable, "-m", "levanter_flax.main", *args], cwd=REPO,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               restore_signals=False)
  finally:
    signal.signal(signal.SIGXFSZ, previous)
  checkpoints = tmp_path / "checkpoints"
  deadline = time.time() + 240
  while time.time() < deadline and not (checkpoints / "2").is_dir():
    time.sleep(0.2)
  resource.prlimit(process.pid, resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
  _, stderr = process.communicate(timeout=240)
  assert process.returncode == 1, stderr[-3000:]
  assert "Traceback" not in stderr, stderr[-5000:]
  last_line = stderr.strip().splitlines()[-1]
  failed = re.fullmatch(rf"levanter_flax: error: writing checkpoint {checkpoints}/(\d+) failed: "
                        rf"File too large; the earlier checkpoints \[([\d, ]+)\] are intact",
                        last_line)
  assert failed, stderr[-5000:]
  earlier = [int(s) for s in failed.group(2).split(", ")]
  manager = ocp.CheckpointManager(checkpoints.absolute(), item_names=("state", "data"))
  assert manager.all_steps() == earlier and int(failed.group(1)) > max(earlier) >= 2
  restored = manager.restore(max(earlier), args=ocp.args.Composite(
      state=ocp.args.StandardRestore(), data=ocp.args.JsonRestore()))
  assert restored.data["windows"] * restored.data["reader_groups"] == max(earlier) * 8


AGREEMENT_WORKER = """
import os, signal, sys, time
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=sys.argv[1], num_processes=2,
                           process_id=int(sys.argv[2]), initialization_timeout=60)
from levanter_flax.checkpoint import preemption
with preemption.StopSignal() as stop:
  if jax.process_index() == 1:
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C on one host: handed on to jax's service.
  step = 1
  while not stop.requested(step) and step < 3000:
    time.sleep(0.01 * (1 + jax.process_index()))  # Process 1 is the slower.
    step += 1
  print(step)
"""


def test_every_process_stops_after_the_same_step_when_one_is_signalled():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{s.getsockname()[1]}"
  processes = [forkserver.Popen([sys.executable, "-c", AGREEMENT_WORKER, address, str(i)], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for i in range(2)]
  results = [p.communicate(timeout=120) for p in processes]
  for process, (stdout, stderr) in zip(processes, results):
    assert process.returncode == 0, stderr[-3000:]
  steps = [int(stdout.splitlines()[-1]) for stdout, _ in results]
  assert steps[0] == steps[1] < 3000, steps


def start_main(*args) -> subprocess.Popen:
  return forkserver.Popen([sys.executable, "-m", "levanter_flax.main", *args], cwd=REPO,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_for_steps(workdir: pathlib.Path, count: int, process: subprocess.Popen) -> None:
  deadline = time.time() + 240
  while time.time() < deadline and process.poll() is None and not (
      (workdir / "metrics.jsonl").exists() and len(train_losses(workdir)) >= count):
    time.sleep(0.2)
  assert process.poll() is None, process.communicate()[1][-3000:]


@pytest.mark.slow
def test_a_second_run_in_a_workdir_is_refused_until_the_first_is_gone(data_cache, tmp_path):
  args = [f"--config={NANO}", f"--workdir={tmp_path}", *TINY, "--config.trainer.batch_size=8",
          "--config.trainer.num_train_steps=100000", "--config.checkpoint.every_steps=2",
          f"--config.data.cache_dir={data_cache}"]
  first = start_main(*args)
  wait_for_steps(tmp_path, 3, first)
  second = forkserver.run([sys.executable, "-m", "levanter_flax.main", *args,
                           "--config.trainer.seed=1"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
  assert second.returncode == 1
  assert "Traceback" not in second.stderr
  assert re.fullmatch(
      rf"levanter_flax: error: workdir {tmp_path} is in use by pid {first.pid} on "
      rf"{re.escape(socket.gethostname())} \(since \d{{4}}-\d\d-\d\dT[\d:]+\+00:00\); wait for it "
      rf"to finish or stop it \(its lock, {tmp_path}/.lock, goes when it exits\)",
      second.stderr.strip().splitlines()[-1]), second.stderr[-3000:]
  assert all(m.get("run/started_at_step", 0) == 0 for m in read_metrics(tmp_path))
  first.kill()  # Its lock dies with it: the next run resumes.
  first.wait()
  stopped_at = max(train_losses(tmp_path))
  resumed = forkserver.run([sys.executable, "-m", "levanter_flax.main", *args,
                            f"--config.trainer.num_train_steps={stopped_at + 2}"], cwd=REPO,
                           capture_output=True, text=True, timeout=300)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert max(train_losses(tmp_path)) == stopped_at + 2


@pytest.mark.slow
def test_rerunning_a_finished_run_says_so(data_cache, tmp_path):
  args = [f"--config={NANO}", f"--workdir={tmp_path}", *TINY, "--config.trainer.batch_size=8",
          "--config.trainer.num_train_steps=3", f"--config.data.cache_dir={data_cache}"]
  for _ in range(2):
    result = forkserver.run([sys.executable, "-m", "levanter_flax.main", *args], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
  assert "Already finished: the newest checkpoint is step 3, and config.trainer.num_train_steps " \
         "is 3" in result.stderr
  assert [m["step"] for m in read_metrics(tmp_path) if "train/loss" in m] == [1, 2, 3]
  # A larger num_train_steps goes on: see test_signal_finishes_the_step_checkpoints_and_exits_zero.


def test_damaged_validation_shards_stop_the_run_before_it_trains(tiny_config, tmp_path):
  directory = prepare_texts(tmp_path / "data", random_documents(60))
  first = load_manifest(directory)["splits"]["validation"][0]
  (directory / first["file"]).write_bytes(b"")  # Listed with documents, holding none.
  tiny_config.data.dataset = str(directory)
  tiny_config.model.seq_len = 16
  with pytest.raises(UserError, match=rf"damaged validation shard {directory / first['file']}: it "
                                      rf"decodes to 0 records and 0 tokens"):
    train_and_evaluate(to_run_config(tiny_config), tmp_path / "run")
  assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_failing_eval_does_not_cost_the_steps_checkpoint(tiny_config, tmp_path, monkeypatch):
  def failing_eval(*args, **kwargs):
    raise UserError("eval failed")
  monkeypatch.setattr(eval_set, "evaluate", failing_eval)
  tiny_config.trainer.num_train_steps = 4
  tiny_config.trainer.eval_every_steps = 2
  tiny_config.checkpoint.every_steps = 2
  with pytest.raises(UserError, match="eval failed"):
    train_and_evaluate(to_run_config(tiny_config), tmp_path)
  assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["2"]


@pytest.mark.slow
def test_a_torn_metrics_line_is_skipped_by_report_and_cut_on_resume(two_steps, tiny_config, tmp_path,
                                                                     caplog):
  taken_up(two_steps, tmp_path)
  with open(tmp_path / "metrics.jsonl", "a", encoding="utf-8") as f:
    f.write('{"step": 3, "train/lo')  # What kill -9 during a write leaves.
  with caplog.at_level(logging.WARNING):
    run = history.load_run(tmp_path, "run")
  assert "metrics.jsonl:" in caplog.text and "torn last record" in caplog.text
  assert max(run.series["train/loss"]) == 2
  tiny_config.trainer.num_train_steps = 3
  train_and_evaluate(to_run_config(tiny_config), tmp_path)
  records = read_metrics(tmp_path)  # Every line is JSON again.
  assert [r["run/started_at_step"] for r in records if "run/started_at_step" in r] == [0, 2]
  assert max(train_losses(tmp_path)) == 3


@pytest.mark.slow
def test_a_full_disk_at_start_is_one_line(data_cache, tmp_path):
  """Files cannot grow past one block (ulimit -f, SIGXFSZ ignored): the first real write fails.

  (Not 0 bytes: TensorFlow's import itself needs a tiny temporary file.)
  """
  limited = ["sh", "-c", 'trap "" XFSZ; ulimit -f 1; exec "$0" "$@"', sys.executable]
  result = forkserver.run([*limited, "-m", "levanter_flax.main", f"--config={NANO}",
                           f"--workdir={tmp_path}", *TINY, "--config.trainer.batch_size=8",
                           "--config.trainer.num_train_steps=2",
                           f"--config.data.cache_dir={data_cache}"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 1, result.stderr[-3000:]
  assert "Traceback" not in result.stderr
  assert result.stderr.strip().splitlines()[-1] == (
      f"levanter_flax: error: cannot write {tmp_path}/config.json: File too large")


def test_an_unwritable_metrics_file_is_one_line(tiny_config, tmp_path):
  (tmp_path / "metrics.jsonl").mkdir()  # As root, a directory is what cannot be opened for append.
  with pytest.raises(UserError, match=f"cannot write the metrics file {tmp_path}/metrics.jsonl: "
                                      f"Is a directory"):
    train_and_evaluate(to_run_config(tiny_config), tmp_path)


@pytest.mark.slow
def test_a_malformed_data_position_is_damage(tiny_config, tmp_path):
  tiny_config.trainer.num_train_steps = 2
  tiny_config.checkpoint.every_steps = 1
  train_and_evaluate(to_run_config(tiny_config), tmp_path / "run")
  for position in ('{}', '{"windows": -40, "per_source": {"train": -40}}'):
    workdir = tmp_path / f"copy{len(position)}"
    shutil.copytree(tmp_path / "run", workdir)
    (workdir / "checkpoints" / "2" / "data" / "metadata").write_text(position)
    tiny_config.trainer.num_train_steps = 3
    train_and_evaluate(to_run_config(tiny_config), workdir)
    assert (workdir / "checkpoints" / "2.unreadable").is_dir()
    assert [m["run/started_at_step"] for m in read_metrics(workdir)
            if "run/started_at_step" in m] == [0, 1]


def test_a_config_json_that_is_no_object_is_named(two_steps, tiny_config, tmp_path):
  taken_up(two_steps, tmp_path)
  (tmp_path / "config.json").write_text("[1, 2]")
  with pytest.raises(UserError, match=f"cannot read {tmp_path}/config.json, the config the "
                                      f"checkpoints were written with: not a JSON object"):
    train_and_evaluate(to_run_config(tiny_config), tmp_path)
  with pytest.raises(UserError, match=f"{tmp_path}/config.json does not describe a model"):
    run_params(tmp_path)
