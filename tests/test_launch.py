"""Experiments: sweeps of work units, the local executor, and what bad input gets."""
import subprocess
import sys

import pytest

from conftest import REPO
from levanter_flax.errors import UserError
from levanter_flax.launch import Experiment, product, sweep, zipit
from levanter_flax.launch.experiment import work_units
from test_main import NANO, TINY


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
                          overrides={"trainer.num_train_steps": 5, "model.remat": "full"})
  [unit] = work_units(experiment)
  assert unit.name == "000_learning_rate=0.001"
  assert unit.flags(NANO) == [f"--config={NANO}", "--config.trainer.num_train_steps=5",
                              "--config.model.remat=full", "--config.optimizer.learning_rate=0.001"]


def test_an_unknown_key_in_a_work_unit_is_named_before_anything_runs():
  experiment = Experiment("e", NANO, [{"trainer.seed": 1}, {"optimizer.learnin_rate": 0.1}])
  with pytest.raises(UserError, match=r"work unit 1 \(optimizer.learnin_rate=0.1\) of experiment e "
                                      r"overrides unknown config key config.optimizer.learnin_rate"):
    work_units(experiment)


def write_experiment(path, units) -> str:
  shared = {k[len("--config."):]: v for k, v in (a.split("=", 1) for a in TINY)}
  path.write_text(f"""
from levanter_flax.launch import Experiment

def get_experiment():
  return Experiment(name="tiny", config={NANO!r}, work_units={units!r}, overrides={shared!r})
""")
  return str(path)


def launch(experiment_file, root, *flags):
  return subprocess.run([sys.executable, "-m", "levanter_flax.launch", experiment_file,
                         f"--root={root}", *flags], cwd=REPO, capture_output=True, text=True,
                        timeout=600)


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


def test_the_xm_executor_says_how_to_install_xmanager(tmp_path):
  # The launcher runs as usual, except that importing xmanager fails as it does where the
  # package is missing (a None entry in sys.modules makes the import raise ImportError), so
  # the test runs whether or not xmanager is installed here.
  experiment = write_experiment(tmp_path / "exp.py", [{}])
  without_xmanager = ("import runpy, sys; sys.modules['xmanager'] = None; "
                      f"sys.argv = ['launch', {experiment!r}, '--root={tmp_path / 'runs'}', "
                      "'--executor=xm']; runpy.run_module('levanter_flax.launch', run_name='__main__')")
  result = subprocess.run([sys.executable, "-c", without_xmanager], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1] == (
      "levanter_flax: error: --executor=xm needs the xmanager package: pip install -e \".[xm]\" "
      "(or pip install xmanager); its Local, Vertex and Kubernetes executors also need Docker")
