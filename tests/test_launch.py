"""Experiments: sweeps of work units, the local executor, and what bad input gets."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import forkserver
from conftest import REPO, train_losses
from levanter_flax.core.errors import UserError
from levanter_flax.launch import Experiment, product, sweep, zipit
from levanter_flax.launch.experiment import work_units
from levanter_flax.launch.local import is_done
from test_main import NANO, TINY
from test_prepare import children, running


def test_product_and_zipit_combine_sweeps():
  lrs, sizes = sweep("optimizer.learning_rate", [1e-3, 3e-3]), sweep("trainer.batch_size", [8, 16])
  assert product(lrs, sizes) == [
      {"optimizer.learning_rate": 1e-3, "trainer.batch_size": 8},
      {"optimizer.learning_rate": 1e-3, "trainer.batch_size": 16},
      {"optimizer.learning_rate": 3e-3, "trainer.batch_size": 8},
      {"optimizer.learning_rate": 3e-3, "trainer.batch_size": 16}]
  assert zipit(lrs, sizes) == [{"optimizer.learning_rate": 1e-3, "trainer.batch_size": 8},
                               {"optimizer.learning_rate": 3e-3, "trainer.batch_size": 16}]
  with pytest.raises(UserError, match=r"zipit needs sweeps of one length; got \[2, 1\]"):
    zipit(lrs, sweep("trainer.seed", [1]))


def test_work_units_carry_shared_and_swept_overrides_as_flags():
  experiment = Experiment("e", NANO, sweep("optimizer.learning_rate", [0.001]),
                          overrides={"trainer.num_train_steps": 5, "model.compute.remat": "full"})
  [unit] = work_units(experiment)
  assert unit.name == "000_learning_rate=0.001"
  assert unit.flags(NANO) == [f"--config={NANO}", "--config.trainer.num_train_steps=5",
                              "--config.model.compute.remat=full", "--config.optimizer.learning_rate=0.001"]
  # What its trainer will save as config.json: the config file with these overrides applied.
  assert {k: unit.resolved[k] for k in ("trainer.num_train_steps", "model.compute.remat",
                                        "optimizer.learning_rate", "model.num_layers")} == {
      "trainer.num_train_steps": 5, "model.compute.remat": "full", "optimizer.learning_rate": 0.001,
      "model.num_layers": 4}


def test_an_unknown_key_in_a_work_unit_is_named_before_anything_runs():
  experiment = Experiment("e", NANO, [{"trainer.seed": 1}, {"optimizer.learnin_rate": 0.1}])
  with pytest.raises(UserError, match=r"work unit 1 \(optimizer.learnin_rate=0.1\) of experiment e "
                                      r"overrides unknown config key config.optimizer.learnin_rate"):
    work_units(experiment)


def test_a_bad_override_value_is_named_with_its_unit_before_anything_runs():
  with pytest.raises(UserError, match=r"^work unit 1 \(trainer.seed=one\) of experiment e: flag "
                                      r"--config.trainer.seed=one: invalid literal for int\(\)"):
    work_units(Experiment("e", NANO, [{"trainer.seed": 1}, {"trainer.seed": "one"}]))
  with pytest.raises(UserError, match=r"^work unit 0 \(no overrides\) of experiment e: config key "
                                      r"config.model.compute.remat must be True, False or one of"):
    work_units(Experiment("e", NANO, [], overrides={"model.compute.remat": "sometimes"}))


def save_config(workdir, config) -> None:
  workdir.mkdir(parents=True, exist_ok=True)
  (workdir / "config.json").write_text(json.dumps(config))


def test_a_unit_is_done_only_when_its_workdir_ran_its_config_to_the_end(tmp_path):
  [unit] = work_units(Experiment("e", NANO, [], overrides={"trainer.num_train_steps": 5}))
  wanted, workdir = unit.resolved, tmp_path / "unit"
  assert not is_done(workdir, wanted)
  (workdir / "checkpoints" / "5").mkdir(parents=True)
  assert not is_done(workdir, wanted)  # No config.json: the trainer resumes (and checks) them.
  save_config(workdir, wanted)
  assert is_done(workdir, wanted)
  # Saved before the key existed: that run did what its default does.
  save_config(workdir, {k: v for k, v in wanted.items() if k != "monitoring.hang_watchdog_seconds"})
  assert is_done(workdir, wanted)
  save_config(workdir, {**wanted, "data.reader_groups": 8})  # What the trainer chose for 0.
  assert is_done(workdir, wanted)
  with pytest.raises(UserError, match=r"\(data.reader_groups 8 -> 4\)"):
    is_done(workdir, {**wanted, "data.reader_groups": 4})
  save_config(workdir, {**wanted, "trainer.num_train_steps": 3})
  assert not is_done(workdir, wanted)  # More steps: the run continues.
  for saved, diff in (({"trainer.num_train_steps": 10}, "trainer.num_train_steps 10 -> 5"),
                      ({"trainer.seed": 1, "trainer.num_train_steps": 3},
                       "trainer.num_train_steps 3 -> 5, trainer.seed 1 -> 0"),
                      # A key missing from config.json means its default, as for a run from
                      # before the key existed.
                      ({"trainer.seed": 1, "trainer.num_train_steps": None},
                       "trainer.num_train_steps 10000 -> 5, trainer.seed 1 -> 0")):
    save_config(workdir, {k: v for k, v in {**wanted, **saved}.items() if v is not None})
    with pytest.raises(UserError) as refused:
      is_done(workdir, wanted)
    assert str(refused.value) == (
        f"{workdir} holds a run of another config ({diff}); only a larger trainer.num_train_steps "
        f"can continue it: use a new --root or experiment name for this one")
  (workdir / "config.json").write_text("{not json")
  with pytest.raises(UserError, match=r"^cannot read .*config.json: Expecting property name"):
    is_done(workdir, wanted)


def test_an_auto_batch_size_unit_is_done_with_the_size_its_run_chose(tmp_path):
  plain, targeted = work_units(Experiment(
      "e", NANO, [{}, {"batch_search.target_batch_size": 32}],
      overrides={"trainer.batch_size": "auto", "trainer.num_train_steps": 5}))
  (tmp_path / "checkpoints" / "5").mkdir(parents=True)
  chose = lambda unit, size, steps: save_config(tmp_path, {
      **unit.resolved, "trainer.batch_size": size, "trainer.gradient_accumulation_steps": steps})
  chose(plain, 24, 1)
  assert is_done(tmp_path, plain.resolved)
  chose(targeted, 32, 4)
  assert is_done(tmp_path, targeted.resolved)
  # What the start chose is kept; the target it was chosen for is still the unit's config.
  with pytest.raises(UserError, match=r"\(batch_search.target_batch_size 32 -> 64\)"):
    is_done(tmp_path, {**targeted.resolved, "batch_search.target_batch_size": 64})


def write_experiment(path, units, shared=None) -> str:
  tiny = {k[len("--config."):]: v for k, v in (a.split("=", 1) for a in TINY)}
  shared = {**tiny, **(shared or {})}
  path.write_text(f"""
from levanter_flax.launch import Experiment

def get_experiment():
  return Experiment(name="tiny", config={NANO!r}, work_units={units!r}, overrides={shared!r})
""")
  return str(path)


def launch(experiment_file, root, *flags):
  return forkserver.run([sys.executable, "-m", "levanter_flax.launch", experiment_file,
                         f"--root={root}", *flags], cwd=REPO, capture_output=True, text=True,
                        timeout=600)


@pytest.mark.slow
def test_local_experiment_runs_its_units_and_a_rerun_skips_them(data_cache, tmp_path):
  units = [{"trainer.num_train_steps": 2, "trainer.seed": s, "data.cache_dir": str(data_cache),
            "trainer.batch_size": 8} for s in (1, 2)]
  experiment = write_experiment(tmp_path / "exp.py", units)
  first = launch(experiment, tmp_path / "runs", "--max_parallel=2")
  assert first.returncode == 0, first.stdout + first.stderr[-3000:]
  assert first.stdout.count("] finished (exit 0)") == 2
  for unit in ("000_num_train_steps=2,seed=1,cache_dir=", "001_num_train_steps=2,seed=2,cache_dir="):
    [workdir] = (tmp_path / "runs" / "tiny").glob(unit + "*")
    assert (workdir / "checkpoints" / "2").is_dir() and (workdir / "log.txt").is_file()
  again = launch(experiment, tmp_path / "runs")
  assert again.returncode == 0, again.stderr[-3000:]
  assert again.stdout.count("] done in an earlier launch") == 2
  assert "started" not in again.stdout


@pytest.mark.slow
def test_a_changed_shared_override_extends_or_refuses_a_finished_unit(data_cache, tmp_path):
  shared = {"data.cache_dir": str(data_cache), "trainer.batch_size": 8}
  units = [{"trainer.seed": 1}, {"trainer.seed": 2, "optimizer.learning_rate": 0.003}]
  experiment = lambda **more: write_experiment(tmp_path / "exp.py", units, {**shared, **more})
  runs = tmp_path / "runs"
  refused_dir = runs / "tiny" / "000_seed=1"
  longer_dir = runs / "tiny" / "001_seed=2,learning_rate=0.003"
  first = launch(experiment(**{"trainer.num_train_steps": 1}), runs, "--max_parallel=2")
  assert first.returncode == 0, first.stdout + first.stderr[-3000:]
  # Unit 1 sets its own learning rate, so only unit 0 sees the new shared one: it is refused,
  # naming the change; unit 1 only needs more steps: its finished run resumes and goes on.
  second = launch(experiment(**{"trainer.num_train_steps": 2, "optimizer.learning_rate": 0.01}),
                  runs, "--max_parallel=2")
  assert second.returncode == 1, second.stdout + second.stderr[-3000:]
  assert [line for line in second.stdout.splitlines() if line.startswith("[000_")] == [
      f"[000_seed=1] refused: {refused_dir} holds a run of another config (optimizer.learning_rate "
      f"0.003 -> 0.01, trainer.num_train_steps 1 -> 2); only a larger trainer.num_train_steps "
      f"can continue it: use a new --root or experiment name for this one"]
  assert "earlier launch" not in second.stdout
  assert "[001_seed=2,learning_rate=0.003] finished (exit 0)" in second.stdout
  assert (longer_dir / "checkpoints" / "2").is_dir()
  table = second.stdout.split("unit ", 1)[1]
  assert [line.split()[:3] for line in table.splitlines()[1:]] == [
      ["000_seed=1", "refused", "-"], ["001_seed=2,learning_rate=0.003", "finished", "0"]]
  assert second.stderr.strip().splitlines()[-1] == (
      "levanter_flax: error: 1 of 2 work units did not finish: 000_seed=1 (refused)")
  starts = [line for line in (refused_dir / "log.txt").read_text().splitlines()
            if line.startswith("$ ")]
  assert len(starts) == 1  # Not started again.


@pytest.mark.slow
def test_a_failing_unit_is_reported_while_the_other_finishes(data_cache, tmp_path):
  good = {"trainer.num_train_steps": 2, "data.cache_dir": str(data_cache), "trainer.batch_size": 8}
  bad = {**good, "data.dataset": str(tmp_path / "missing")}
  result = launch(write_experiment(tmp_path / "exp.py", [good, bad]), tmp_path / "runs",
                  "--max_parallel=2")
  assert result.returncode == 1
  table = result.stdout.split("unit ", 1)[1]
  assert [line.split()[1:3] for line in table.splitlines()[1:]] == [["finished", "0"],
                                                                    ["failed", "1"]]
  assert result.stderr.strip().splitlines()[-1].startswith(
      "levanter_flax: error: 1 of 2 work units did not finish: 001_")
  [bad_dir] = (tmp_path / "runs" / "tiny").glob("001_*")
  assert f"{tmp_path / 'missing'}" in (bad_dir / "log.txt").read_text()


def start_until_it_trains(experiment_file, root, workdir_glob: str, after_step: int):
  """A launch, its unit's pid and workdir once the unit has logged a step after `after_step`."""
  launcher = forkserver.Popen([sys.executable, "-m", "levanter_flax.launch", experiment_file,
                               f"--root={root}"], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 240
  while time.time() < deadline:
    units = children(launcher.pid)
    workdirs = list(root.glob(workdir_glob))
    if units and workdirs and (workdirs[0] / "metrics.jsonl").exists() and max(
        train_losses(workdirs[0]), default=0) > after_step:
      return launcher, units[0], workdirs[0]
    assert launcher.poll() is None, launcher.communicate()
    time.sleep(0.5)
  raise AssertionError("the unit logged no step in time")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="Linux only: PR_SET_PDEATHSIG, and the processes are found in /proc")
def test_a_hangup_or_a_killed_launch_stops_its_units_with_a_checkpoint(data_cache, tmp_path):
  endless = {"trainer.num_train_steps": 100000, "checkpoint.every_steps": 100000,
             "data.cache_dir": str(data_cache), "trainer.batch_size": 8}
  experiment = write_experiment(tmp_path / "exp.py", [endless])
  runs, units = tmp_path / "runs", []
  try:
    # A closed terminal: SIGTERM passed on, the unit's checkpoint waited for.
    launcher, unit, workdir = start_until_it_trains(experiment, runs, "tiny/000*", 0)
    units.append(unit)
    launcher.send_signal(signal.SIGHUP)
    stdout, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode == 1, stdout + stderr[-3000:]
    assert f"[{workdir.name}] interrupted (exit 0)" in stdout
    assert not running(unit)
    [stopped_at] = [int(p.name) for p in (workdir / "checkpoints").iterdir()]
    # A launch killed outright: its unit is sent SIGTERM by the kernel and stops the same way.
    launcher, unit, _ = start_until_it_trains(experiment, runs, "tiny/000*", stopped_at)
    units.append(unit)
    launcher.kill()
    launcher.communicate()
    deadline = time.time() + 120
    while running(unit) and time.time() < deadline:
      time.sleep(0.2)
    assert not running(unit)
    assert max(int(p.name) for p in (workdir / "checkpoints").iterdir()) > stopped_at
    assert (workdir / "log.txt").read_text().count("on request; its checkpoint is written") == 2
  finally:
    for unit in filter(running, units):  # Orphans, when the launch cannot take them along.
      os.kill(unit, signal.SIGKILL)


def test_the_xm_executor_says_how_to_install_xmanager(tmp_path):
  # The launcher runs as usual, except that importing xmanager fails as it does where the
  # package is missing (a None entry in sys.modules makes the import raise ImportError), so
  # the test runs whether or not xmanager is installed here.
  experiment = write_experiment(tmp_path / "exp.py", [{}])
  without_xmanager = ("import runpy, sys; sys.modules['xmanager'] = None; "
                      f"sys.argv = ['launch', {experiment!r}, '--root={tmp_path / 'runs'}', "
                      "'--executor=xm']; runpy.run_module('levanter_flax.launch', run_name='__main__')")
  result = forkserver.run([sys.executable, "-c", without_xmanager], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1] == (
      "levanter_flax: error: --executor=xm needs the xmanager package: pip install -e \".[xm]\" "
      "(or pip install xmanager); its Local, Vertex and Kubernetes executors also need Docker")
