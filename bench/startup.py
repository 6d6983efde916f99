"""Time from launch to the first finished train step, with a cold compilation cache, then warm.

    python bench/startup.py --config=configs/gpt2_nano.py [--config.x=y ...]

Each measurement is a fresh Python process that imports jax, builds the
config's model and train step, compiles it with the persistent compilation
cache in a new directory (cold) or the one the cold run filled (warm), and
runs one step on a synthetic batch. Uses jax, flax, optax, absl and
ml_collections; no TensorFlow.
"""
import os
import subprocess
import sys
import tempfile
import time

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "A config file in configs/.")
_CHILD_CACHE = flags.DEFINE_string("child_cache", "", "Internal: run as the measured child.")
flags.mark_flag_as_required("config")


def first_step(cache_dir: str) -> None:
  """The child: everything a training launch does before its first step, then that step."""
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_compilation_cache_dir", cache_dir)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  from common import compile_train_step  # pylint: disable=g-import-not-at-top
  from levanter_flax.config import to_run_config  # pylint: disable=g-import-not-at-top
  compiled = compile_train_step(to_run_config(_CONFIG.value))
  compiled.step_once()
  print(f"compile {compiled.compile_seconds:.2f} s")


def launch(cache_dir: str) -> tuple[float, str]:
  start = time.perf_counter()
  args = sys.argv[1:] + [f"--child_cache={cache_dir}"]
  result = subprocess.run([sys.executable, os.path.abspath(__file__), *args], capture_output=True,
                          text=True, check=True)
  return time.perf_counter() - start, result.stdout.strip().splitlines()[-1]


def main(argv):
  del argv
  if _CHILD_CACHE.value:
    first_step(_CHILD_CACHE.value)
    return
  with tempfile.TemporaryDirectory() as cache_dir:
    cold, cold_compile = launch(cache_dir)
    warm, warm_compile = launch(cache_dir)
  print(f"launch to first step: cold cache {cold:.2f} s ({cold_compile}), "
        f"warm cache {warm:.2f} s ({warm_compile}): {1 - warm / cold:.0%} less")


if __name__ == "__main__":
  app.run(main)
