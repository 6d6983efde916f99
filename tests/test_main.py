"""The command line as a user runs it: overrides reach the trainer, bad input is one line."""
import importlib.util
import os
import subprocess
import sys

import pytest

import forkserver
from conftest import REPO, read_metrics
from levanter_flax.core.errors import UserError

NANO = str(REPO / "configs" / "gpt2_nano.py")
# One reader group: the default 8 each build a pipeline and decode a shard before the first
# batch, 2 s of every run's start. Tests of the default set it back to 0.
TINY = ["--config.model.seq_len=64", "--config.model.num_layers=1", "--config.model.hidden_dim=64",
        "--config.trainer.log_every_steps=1", "--config.trainer.eval_tokens=512",
        "--config.data.reader_groups=1"]


def run_main(*args, cwd=REPO):
  return forkserver.run([sys.executable, "-m", "levanter_flax.main", *args], cwd=cwd,
                        capture_output=True, text=True, timeout=300)


def assert_one_line_error(result, *fragments):
  assert result.returncode != 0
  errors = [line for line in result.stderr.splitlines() if line.startswith("levanter_flax: error:")]
  assert len(errors) == 1, result.stderr[-3000:]
  for fragment in fragments:
    assert fragment in errors[0]
  assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_overrides_reach_the_trainer(data_cache, tmp_path):
  result = run_main(f"--config={NANO}", f"--workdir={tmp_path}", *TINY,
                    "--config.trainer.num_train_steps=3", "--config.trainer.batch_size=8",
                    f"--config.data.cache_dir={data_cache}")
  assert result.returncode == 0, result.stderr[-3000:]
  assert [m["step"] for m in read_metrics(tmp_path) if "train/loss" in m] == [1, 2, 3]
  assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["3"]
  # The batch size override reaches the mesh check: 12 does not split over 8 devices.
  result = run_main(f"--config={NANO}", f"--workdir={tmp_path / 'b'}", *TINY,
                    "--config.trainer.batch_size=12", f"--config.data.cache_dir={data_cache}")
  assert_one_line_error(result, "config.trainer.batch_size (12)")
  # It does over 3, which cpu_devices splits the CPU into, overriding the 8 XLA_FLAGS asks for.
  result = run_main(f"--config={NANO}", f"--workdir={tmp_path / 'c'}", *TINY,
                    "--config.trainer.num_train_steps=1", "--config.trainer.batch_size=12",
                    "--config.trainer.cpu_devices=3", f"--config.data.cache_dir={data_cache}")
  assert result.returncode == 0, result.stderr[-3000:]
  assert "mesh {'data': 3, 'model': 1}" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("config", [f"{REPO}/configs/gpt2.py:nano", "gpt2:nano"])
def test_workdir_defaults_to_runs_config_name(config, data_cache, tmp_path):
  """runs/<file>_<variant>: configs/gpt2.py:nano's is configs/gpt2_nano.py's, runs/gpt2_nano;
  so is the shipped config's by name, outside the checkout."""
  result = run_main(f"--config={config}", *TINY,
                    "--config.trainer.num_train_steps=1", "--config.trainer.batch_size=8",
                    f"--config.data.cache_dir={data_cache}", cwd=tmp_path)
  assert result.returncode == 0, result.stderr[-3000:]
  assert (tmp_path / "runs" / "gpt2_nano" / "metrics.jsonl").exists()


@pytest.mark.parametrize("args, fragments", [
    (["--config.trainer.batch_sise=3"], ["unknown config key --config.trainer.batch_sise",
                                         "did you mean 'batch_size'"]),
    (["--config.trainer.num_train_steps=abc"], ["--config.trainer.num_train_steps=abc"]),
    (["--config.trainer.batch_size=abc"],
     ["config key config.trainer.batch_size must be a positive int or 'auto'; got 'abc'"]),
    (["--config.trainr.batch_size=3"], ["unknown config key --config.trainr.batch_size"]),
    (["--config.trainer.cpu_devices=-2"], ["config.trainer.cpu_devices", ">= 0"]),
])
def test_bad_overrides_are_one_line(args, fragments):
  assert_one_line_error(run_main(f"--config={NANO}", *args), *fragments)


@pytest.mark.parametrize("argument, message", [
    ("configs/gpt2.py:x", "config file configs/gpt2.py: unknown variant 'x'; choose one of nano, "
                          "small, medium, small_fast"),
    ("configs/gpt2_nano.py:x",
     "config file configs/gpt2_nano.py is gpt2.py:nano and takes no variant; got 'x'"),
])
def test_a_bad_variant_is_one_line(argument, message):
  result = run_main(f"--config={argument}")
  assert result.returncode == 1
  assert_one_line_error(result, message)


def test_missing_config_file_is_one_line():
  assert_one_line_error(run_main("--config=configs/nope.py"), "config file configs/nope.py does not exist")
  assert_one_line_error(run_main("--config=gpt3:nano"), "config file gpt3 does not exist, and is "
                        "no shipped config's name; shipped: deepseek_v3, gemma3, gpt2, gpt2_medium,")


def test_a_config_file_without_get_config_is_one_line_naming_it(tmp_path):
  """Not "unknown config key config_config" (config_flags' name for the file's module)."""
  (tmp_path / "no_function.py").write_text("from levanter_flax.config import default_config\n")
  assert_one_line_error(run_main(f"--config={tmp_path}/no_function.py"),
                        f"config file {tmp_path}/no_function.py defines no get_config()")


def test_missing_config_flag_is_one_line():
  assert_one_line_error(run_main(), "--config")


@pytest.mark.slow
def test_unwritable_workdir_is_one_line(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  assert_one_line_error(run_main(f"--config={NANO}", f"--workdir={blocker}/run"),
                        f"cannot create workdir {blocker}/run")


@pytest.mark.slow
def test_unwritable_cache_dir_is_one_line(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  assert_one_line_error(run_main(f"--config={NANO}", f"--workdir={tmp_path}/run",
                                 f"--config.data.cache_dir={blocker}"),
                        f"cannot create dataset directory {blocker}/")


@pytest.mark.slow
@pytest.mark.parametrize("args, fragment", [
    (["--config.data.dataset=/nowhere/data"],
     "/nowhere/data is not a prepared dataset (no manifest.json); run levanter-flax prepare"),
    (["--config.data.tokenizer=/nowhere/tokenizer.json"],
     "tokenizer '/nowhere/tokenizer.json' is neither 'byte' nor an existing tokenizer.json"),
])
def test_bad_data_settings_are_one_line(data_cache, tmp_path, args, fragment):
  assert_one_line_error(run_main(f"--config={NANO}", f"--workdir={tmp_path}",
                                 f"--config.data.cache_dir={data_cache}", *args), fragment)


@pytest.mark.slow
def test_compilation_cache_and_mfu(data_cache, tmp_path):
  result = run_main(f"--config={NANO}", f"--workdir={tmp_path}/run", *TINY,
                    "--config.trainer.num_train_steps=2", "--config.trainer.batch_size=16",
                    "--config.trainer.gradient_accumulation_steps=2",
                    f"--config.trainer.jax_compilation_cache_dir={tmp_path}/cache",
                    "--config.trainer.jax_persistent_cache_min_compile_time_secs=0",
                    "--config.trainer.peak_flops_per_device=1e11",
                    f"--config.data.cache_dir={data_cache}")
  assert result.returncode == 0, result.stderr[-3000:]
  assert list((tmp_path / "cache").iterdir())
  logged = [m for m in read_metrics(tmp_path / "run") if "train/mfu" in m]
  assert logged and 0 < logged[-1]["train/mfu"] < 1
  assert logged[-1]["train/model_tflops_per_device"] == pytest.approx(logged[-1]["train/mfu"] * 0.1)


def test_the_cache_threshold_is_jaxs_own_unless_the_config_sets_one():
  import jax
  from levanter_flax.config.settings import TrainerConfig
  from levanter_flax.core.errors import UserError
  from levanter_flax.training import loop
  key = "jax_persistent_cache_min_compile_time_secs"
  before = getattr(jax.config, key)
  try:
    jax.config.update(key, 7.0)  # as $JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS would
    loop._use_compilation_cache(TrainerConfig())
    assert getattr(jax.config, key) == 7.0
    loop._use_compilation_cache(TrainerConfig(**{key: 0.5}))
    assert getattr(jax.config, key) == 0.5
  finally:
    jax.config.update(key, before)
  with pytest.raises(UserError, match=rf"config.trainer.{key} must be >= 0, or -1 .*; got -0.5"):
    TrainerConfig(**{key: -0.5})


@pytest.mark.slow
def test_the_debug_switch_shows_the_traceback_behind_a_one_line_error(data_cache, tmp_path):
  """Without the switch, test_bad_data_settings_are_one_line shows the same line alone."""
  args = [f"--config={NANO}", f"--workdir={tmp_path}", f"--config.data.cache_dir={data_cache}",
          "--config.data.dataset=/nowhere/data"]
  loud = forkserver.run([sys.executable, "-m", "levanter_flax.main", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=300,
                        env={**os.environ, "LEVANTER_FLAX_DEBUG": "1"})
  assert loud.returncode == 1
  assert "Traceback (most recent call last)" in loud.stderr
  assert "in load_manifest" in loud.stderr
  assert loud.stderr.strip().splitlines()[-1].startswith(
      "levanter_flax: error: /nowhere/data is not a prepared dataset (no manifest.json)")


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs the tpu-aot extra")
def test_libtpu_is_silent_on_a_machine_without_a_tpu():
  """Every jax command starts through backend (main, api) or backend.open_devices (sample,
  serve, evaluate, export_hf); with libtpu installed and no chip, jax would try the chip and say
  so."""
  from jax._src import hardware_utils  # pylint: disable=g-import-not-at-top
  if hardware_utils.num_available_tpu_chips_and_device_id()[0] or hardware_utils.has_visible_nvidia_gpu():
    pytest.skip("a TPU or GPU machine: skip_absent_tpu rightly leaves jax's platforms alone")
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  script = ("from levanter_flax.parallel import backend; backend.skip_absent_tpu(); import jax; "
            "print(jax.default_backend())")
  result = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.strip() == "cpu"
  assert "tpu" not in result.stderr.lower(), result.stderr[-2000:]


# What libtpu says, as seen on a TPU v5e host, when a second program opens the chip.
HELD_CHIP = ("Unable to initialize backend 'tpu': ABORTED: Internal error when accessing libtpu "
             "multi-process lockfile. Run \"$ sudo rm /tmp/libtpu_lockfile\". (set "
             "JAX_PLATFORMS='' to automatically choose an available backend)")


@pytest.mark.parametrize("opener", ["open_devices", "start", "start_distributed"])
def test_a_chip_another_process_holds_is_one_line(opener, monkeypatch, tiny_config):
  """Not libtpu's advice to delete its lockfile, which the holder still needs. On a pod,
  jax.distributed's start opens the chip first."""
  from levanter_flax.config import to_run_config  # pylint: disable=g-import-not-at-top
  from levanter_flax.parallel import backend  # pylint: disable=g-import-not-at-top

  def held(*args):
    raise RuntimeError(HELD_CHIP)
  if opener == "start_distributed":
    monkeypatch.setattr(backend, "_distributed_started", lambda: False)
    monkeypatch.setattr(backend.distributed, "initialize", held)
  else:
    monkeypatch.setattr(backend.jax, "devices", held)
  with pytest.raises(UserError, match=r"^another process holds this machine's TPU .*"
                     r"JAX_PLATFORMS=cpu runs on the CPU instead$"):
    if opener.startswith("start"):
      backend.start(to_run_config(tiny_config).trainer)
    else:
      backend.open_devices()
  monkeypatch.setattr(backend.jax, "devices", lambda: (_ for _ in ()).throw(RuntimeError("other")))
  with pytest.raises(RuntimeError, match="^other$"):  # Any other failure is jax's own.
    backend.open_devices()


@pytest.mark.parametrize("module, subcommand", [
    ("prepare", "prepare"), ("sample", "sample"), ("evaluate", "evaluate"),
    ("export_hf", "export-hf"), ("aot", "aot"), ("report", "report")])
def test_the_old_module_paths_run_their_command_and_say_what_replaces_them(module, subcommand):
  result = forkserver.run([sys.executable, "-m", f"levanter_flax.{module}", "--no_such_flag"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
  lines = result.stderr.strip().splitlines()
  assert result.returncode == 1, result.stderr[-3000:]
  assert lines[0] == (f"levanter_flax: `python -m levanter_flax.{module}` is now "
                      f"`levanter-flax {subcommand}` (python -m levanter_flax.commands.{module})")
  assert lines[-1] == "levanter_flax: error: Unknown command line flag 'no_such_flag'"
