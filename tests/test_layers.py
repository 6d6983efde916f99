"""The layer contract of .importlinter: kept by the code, and broken by an upward import or an
import cycle (checked on a copy of the package, so the test can fail)."""
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from conftest import REPO

pytest.importorskip("importlinter")


def lint_imports(root: pathlib.Path) -> subprocess.CompletedProcess:
  """`lint-imports` on the package under `root`, with root's .importlinter."""
  return subprocess.run(
      [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
       "sys.exit(lint_imports_command())", "--config", str(root / ".importlinter")],
      cwd=root, capture_output=True, text=True, timeout=120,
      env={**os.environ, "PYTHONPATH": str(root)})


def copy_of_the_package(tmp_path: pathlib.Path) -> pathlib.Path:
  shutil.copytree(REPO / "levanter_flax", tmp_path / "levanter_flax",
                  ignore=shutil.ignore_patterns("__pycache__"))
  shutil.copy(REPO / ".importlinter", tmp_path)
  return tmp_path


def test_the_code_keeps_the_layers_and_has_no_import_cycle():
  result = lint_imports(REPO)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
  assert "2 kept, 0 broken" in result.stdout


@pytest.mark.parametrize("module, line, broken", [
    # core, the lowest layer, reaching up to the training loop.
    ("core/errors.py", "from levanter_flax.training import loop", "levanter_flax.core.errors -> "
     "levanter_flax.training.loop"),
    # Two modules of one package importing each other.
    ("data/shards.py", "from levanter_flax.data import dataset_writer",
     "No import cycle, between the modules of any package BROKEN"),
])
def test_an_upward_import_or_a_cycle_breaks_the_contract(tmp_path, module, line, broken):
  root = copy_of_the_package(tmp_path)
  path = root / "levanter_flax" / module
  path.write_text(path.read_text() + f"\n{line}\n")
  result = lint_imports(root)
  assert result.returncode != 0
  assert broken in result.stdout, result.stdout[-3000:]
