"""The Python API: `import levanter_flax as lf`, lf.train with callbacks, lf.load, and the
README's example run as written."""
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

import levanter_flax as lf
from levanter_flax.core.errors import UserError

import forkserver
from conftest import REPO, xla_flags


def _readme_example() -> str:
  """The README's Python API example: the python block under "## Python API"."""
  section = (REPO / "README.md").read_text().split("\n## Python API\n", 1)[1].split("\n## ", 1)[0]
  blocks = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
  assert len(blocks) == 1, "the Python API section should show one example"
  return blocks[0]


@pytest.mark.slow
def test_import_is_light_and_exports_lazily():
  code = ("import sys, levanter_flax as lf\n"
          "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
          "('jax', 'flax', 'tensorflow', 'orbax'))\n"
          "assert not heavy, heavy\n"
          "print(lf.__version__, lf.Callback.__module__, lf.train.__module__)\n"
          "import levanter_flax.training.loop\n"
          "assert lf.train.__module__ == 'levanter_flax.commands.api', lf.train\n"
          "lf.nothing\n")
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                        check=False)
  assert done.returncode == 1, done.stderr
  assert "module 'levanter_flax' has no attribute 'nothing'" in done.stderr
  version, *modules = done.stdout.split()
  assert re.fullmatch(r"\d+\.\d+\.\d+", version)
  assert modules == ["levanter_flax.training.callbacks", "levanter_flax.commands.api"]
  setup = (REPO / "setup.py").read_text()
  assert "version=_version()" in setup and version not in setup  # One place holds it.


@pytest.mark.slow
def test_the_readme_example_runs_as_written(data_cache, tmp_path):
  """In a fresh directory whose ~/.cache/levanter_flax is the session's prepared corpus, on one
  CPU device as a plain CPU run has."""
  home = tmp_path / "home"
  (home / ".cache").mkdir(parents=True)
  (home / ".cache" / "levanter_flax").symlink_to(data_cache)
  env = {**os.environ, "HOME": str(home), "PYTHONPATH": str(REPO), "XLA_FLAGS": xla_flags(1)}
  done = forkserver.run([sys.executable, "-c", _readme_example()], capture_output=True, text=True,
                        cwd=tmp_path, env=env, check=False, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  assert re.findall(r"^step (\d+): loss \d+\.\d+$", done.stdout, re.MULTILINE) == ["10", "20"]
  assert re.search(r"^eval loss \d+\.\d+ after step 20$", done.stdout, re.MULTILINE)
  assert (tmp_path / "runs" / "api_nano" / "checkpoints" / "20").is_dir()


def _recorder(seen: list):
  def record(step, state, metrics):
    assert int(state.step) == step  # The step's own state, not a later one.
    seen.append((step, sorted(k for k in metrics if k.startswith("eval/")),
                 metrics["train/loss"]))
  return record


@pytest.mark.slow
def test_callbacks_see_every_nth_step_and_params_are_the_checkpoints(tiny_config, tmp_path):
  every_3, every_5 = [], []
  workdir = str(tmp_path / "run")  # A str, as a user passes it.
  result = lf.train(tiny_config, workdir, callbacks=[lf.Callback(3, _recorder(every_3)),
                                                     lf.Callback(5, _recorder(every_5))])
  assert [step for step, _, _ in every_3] == [3, 6, 9]
  assert [step for step, _, _ in every_5] == [5, 10]
  # Steps 5 and 10 evaluate (eval_every_steps=5): their callbacks see it; step 3's does not.
  assert all(evals and "eval/loss" in evals for _, evals, _ in every_5)
  assert every_3[0][1] == []
  assert all(np.isfinite(loss) for _, _, loss in every_3 + every_5)
  assert int(result.state.step) == 10
  assert {"train/loss", "eval/loss"} <= set(result.metrics)

  loaded = lf.load(workdir)
  trained = jax.device_get(result.params)
  assert jax.tree.structure(loaded.params) == jax.tree.structure(trained)
  for saved, final in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(trained)):
    np.testing.assert_array_equal(saved, final)
  assert loaded.config["trainer.num_train_steps"] == 10
  tokens = loaded.tokenizer.encode("def f(")[None]
  logits = loaded.model.apply({"params": loaded.params}, tokens)
  assert logits.shape == (1, tokens.shape[1], loaded.model_config.vocab_size)

  # Twice in one process: a run that already finished returns its newest checkpoint's state;
  # a later num_train_steps trains on, and the callback counts from the run's start.
  again = lf.train(tiny_config, tmp_path / "run")
  assert again.metrics == {} and int(again.state.step) == 10
  tiny_config.trainer.num_train_steps = 12
  later = []
  resumed = lf.train(tiny_config, workdir, callbacks=[lf.Callback(3, _recorder(later))])
  assert [step for step, _, _ in later] == [12] and int(resumed.state.step) == 12


def test_a_config_by_name_and_bad_input_are_named(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # Shipped names do not depend on the working directory.
  assert lf.load_config("gpt2:nano").model.num_layers == 4
  with pytest.raises(UserError, match=r"^config file gpt3 does not exist, and is no shipped "
                                      r"config's name; shipped: deepseek_v3, gemma3, gpt2, .*gpt2_nano"):
    lf.train("gpt3", tmp_path / "run")
  with pytest.raises(UserError, match="Callback every_steps must be a positive int; got 0"):
    lf.Callback(0, print)
  with pytest.raises(UserError, match="must be levanter_flax.Callback"):
    lf.train("gpt2:nano", tmp_path / "run", callbacks=[print])
  with pytest.raises(UserError, match=r"^callbacks must be a list of levanter_flax.Callback\("
                                      r"every_steps, fn\); got Callback\(every_steps=2"):
    lf.train("gpt2:nano", tmp_path / "run", callbacks=lf.Callback(2, print))
  with pytest.raises(UserError, match="config must be a ConfigDict"):
    lf.train({"model": {}}, tmp_path / "run")
  with pytest.raises(UserError, match="has no config.json: not a levanter_flax workdir"):
    lf.load(tmp_path)
  assert not (tmp_path / "run").exists()  # Refused before the workdir was made.


def test_a_cpu_split_jax_cannot_take_is_refused(tiny_config, tmp_path):
  """This process's jax already runs on 8 CPU devices (conftest's flags)."""
  assert jax.device_count() == 8  # Started here, whatever ran before in this process.
  tiny_config.trainer.cpu_devices = 3
  with pytest.raises(UserError, match=r"config.trainer.cpu_devices is 3, but jax already runs "
                                      r"in this process with 8 CPU devices"):
    lf.train(tiny_config, tmp_path / "run")


class _Unreadable:
  """A step's metric that may not be read: a callback that is not due must not touch it."""

  def __array__(self, *args, **kwargs):
    raise AssertionError("read a step's metrics on a step no callback was due")


def test_a_step_no_callback_is_due_on_reads_nothing_from_the_device():
  from levanter_flax.training.callbacks import Callbacks
  seen = []
  due = Callbacks([lf.Callback(4, lambda step, state, metrics: seen.append((step, metrics)))])
  for step in (1, 2, 3, 5):
    due.after_step(step, None, {"train/loss": _Unreadable()}, {})
  assert not seen
  due.after_step(4, None, {"train/loss": jax.numpy.float32(2.5)}, {"eval/loss": 3.0})
  assert seen == [(4, {"train/loss": 2.5, "eval/loss": 3.0})]
