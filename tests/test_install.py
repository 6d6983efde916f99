"""A non-editable install, used from outside the checkout: the wheel holds the configs and the
`levanter-flax` console script, and they work from any directory."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, xla_flags


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
  """(site directory, its levanter-flax script): the checkout's wheel, installed with
  `pip install --target` (its dependencies are the test venv's own)."""
  root = tmp_path_factory.mktemp("install")
  source = root / "source"  # A copy: building writes build/ and an egg-info beside setup.py.
  shutil.copytree(REPO / "levanter_flax", source / "levanter_flax",
                  ignore=shutil.ignore_patterns("__pycache__"))
  shutil.copy(REPO / "setup.py", source)
  pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
  subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", root / "wheels",
                  source], check=True, cwd=root)
  wheel, = (root / "wheels").glob("levanter_flax-*.whl")
  subprocess.run([*pip, "install", "--no-deps", "--target", root / "site", wheel], check=True,
                 cwd=root)
  return root / "site", root / "site" / "bin" / "levanter-flax"


def _run(command: list, site, cwd, **env) -> subprocess.CompletedProcess:
  """`command` in `cwd`, outside the checkout, importing the installed copy (PYTHONPATH comes
  before the venv's site-packages, which may hold an editable install of the checkout)."""
  env = {**os.environ, "PYTHONPATH": str(site), **env}
  return subprocess.run([str(c) for c in command], capture_output=True, text=True, cwd=cwd,
                        env=env, check=False, timeout=600)


@pytest.mark.slow
def test_the_installed_package_finds_its_shipped_configs(installed, tmp_path):
  site, script = installed
  where = _run([sys.executable, "-c", "import levanter_flax as lf; from levanter_flax import "
                "config; print(lf.__file__); print(config.find_config_file('gpt2_nano', 'x')); "
                "print(config.load_preset('optim/sophia_h_large').name)"], site, tmp_path)
  assert where.returncode == 0, where.stderr
  package, config_file, preset = where.stdout.split()
  assert package == str(site / "levanter_flax" / "__init__.py")
  assert config_file == str(site / "levanter_flax" / "configs" / "gpt2_nano.py")
  assert preset == "sophia_h"

  by_module = _run([sys.executable, "-m", "levanter_flax.main", "--config=gpt2_nano",
                    "--print_config"], site, tmp_path)
  assert by_module.returncode == 0, by_module.stderr
  assert "config.model.num_layers = 4" in by_module.stdout
  by_script = _run([script, "train", "--config=gpt2:nano", "--print_config"], site, tmp_path)
  assert by_script.returncode == 0, by_script.stderr
  assert by_script.stdout == by_module.stdout

  unknown = _run([script, "train", "--config=gpt3"], site, tmp_path)
  assert unknown.returncode == 1 and unknown.stdout == ""
  assert unknown.stderr.count("\n") == 1
  assert unknown.stderr.startswith("levanter_flax: error: config file gpt3 does not exist, and "
                                   "is no shipped config's name; shipped: deepseek_v3, gemma3, gpt2, ")
  wrong = _run([script, "evaluat"], site, tmp_path)
  assert wrong.returncode == 1
  assert wrong.stderr == ("levanter_flax: error: unknown subcommand 'evaluat'; choose one of "
                          "train, prepare, evaluate, sample, serve, export-hf, report, launch, aot\n")
  assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_the_installed_script_trains(installed, tmp_path, data_cache):
  """Two steps of gpt2:nano and its eval, on one CPU device; the default workdir runs/gpt2_nano
  is under the directory it runs in."""
  site, script = installed
  done = _run([script, "train", "--config=gpt2:nano", "--config.trainer.num_train_steps=2",
               "--config.trainer.eval_tokens=4096", f"--config.data.cache_dir={data_cache}"],
              site, tmp_path, XLA_FLAGS=xla_flags(1))
  assert done.returncode == 0, done.stderr[-3000:]
  workdir = tmp_path / "runs" / "gpt2_nano"
  logged = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert any(m["step"] == 2 and "eval/loss" in m for m in logged)
  assert (workdir / "checkpoints" / "2").is_dir()
