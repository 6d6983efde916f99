"""Starting jax for a run: what must come before any backend exists, then jax.distributed.

The train command (commands/train.py) and the Python API (commands/api.py) start it the same way. A process may
start it more than once (lf.train called twice): what is already so is kept, and what can no
longer change is named.
"""
import contextlib
import importlib.util
import os

import jax
from absl import logging

from levanter_flax.parallel import distributed, partitioning
from levanter_flax.core.errors import UserError


def start(trainer) -> None:
  """The CPU split (trainer.cpu_devices) and jax.distributed (trainer.distributed); then only
  process 0 logs progress."""
  if _backends_exist():
    _check_cpu_split(trainer.cpu_devices)
  else:
    skip_absent_tpu()
    partitioning.split_cpu(trainer.cpu_devices)
  with _held_chip_named():  # jax.distributed starts the backends too, on a pod.
    if not _distributed_started():
      distributed.initialize(trainer.distributed)
    jax.devices()
  if jax.process_index() > 0:
    logging.set_verbosity(logging.WARNING)


def open_devices() -> None:
  """For commands that run on one host's devices (sample, serve, evaluate, export-hf): the CPU
  alone where there is no chip (skip_absent_tpu), and the backends started now."""
  skip_absent_tpu()
  with _held_chip_named():
    jax.devices()


@contextlib.contextmanager
def _held_chip_named():
  """Around what starts jax's backends, so that a chip another process holds is one line here,
  not a traceback from wherever jax first looks (libtpu lets one program at a time hold one)."""
  try:
    yield
  except RuntimeError as e:
    text = str(e)
    if "backend 'tpu'" in text and ("lockfile" in text or "already in use" in text):
      raise UserError(
          "another process holds this machine's TPU (libtpu lets one program at a time open "
          "it): wait for it to end, or find it with `sudo lsof -w /dev/accel* /dev/vfio/*`; "
          "JAX_PLATFORMS=cpu runs on the CPU instead") from None
    raise


def skip_absent_tpu() -> None:
  """Runs jax on the CPU alone where this machine has no TPU chip and no GPU but libtpu is
  installed (the tpu-aot extra, for `aot`): jax would otherwise start libtpu for the missing
  chip at every command and print its failure on stderr. A JAX_PLATFORMS the user set is kept;
  `aot`, which asks for a TPU, does not come here (its topology needs no TPU backend)."""
  # The checks jax's own TPU start makes (cloud_tpu_init); no public query.
  from jax._src import hardware_utils  # pylint: disable=g-import-not-at-top
  if (_backends_exist() or jax.config.jax_platforms or importlib.util.find_spec("libtpu") is None
      or hardware_utils.num_available_tpu_chips_and_device_id()[0]
      or hardware_utils.has_visible_nvidia_gpu() or os.path.exists("/dev/kfd")):
    return
  jax.config.update("jax_platforms", "cpu")


def _backends_exist() -> bool:
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top  # No public query.
  return xla_bridge.backends_are_initialized()


def _distributed_started() -> bool:
  from jax._src import distributed as jax_distributed  # pylint: disable=g-import-not-at-top
  return jax_distributed.global_state.client is not None


def _check_cpu_split(cpu_devices: int) -> None:
  """The CPU split of a backend that already exists (jax ran before in this process): it can no
  longer change, so a run that asks for another is refused."""
  if not cpu_devices or jax.default_backend() != "cpu":
    return  # JAX's default, or a split that applies to CPU backends only.
  have = jax.local_device_count()
  if have != cpu_devices:
    raise UserError(f"config.trainer.cpu_devices is {cpu_devices}, but jax already runs in this "
                    f"process with {have} CPU devices, which it cannot change: set it to {have} "
                    f"(or 0), or train in a fresh process")
