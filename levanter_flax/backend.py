"""Starting jax for a run: what must come before any backend exists, then jax.distributed.

The command line (main.py) and the Python API (api.py) start it the same way. A process may
start it more than once (lf.train called twice): what is already so is kept, and what can no
longer change is named.
"""
import jax
from absl import logging

from levanter_flax import distributed, partitioning
from levanter_flax.errors import UserError


def start(trainer) -> None:
  """The CPU split (trainer.cpu_devices) and jax.distributed (trainer.distributed); then only
  process 0 logs progress."""
  if _backends_exist():
    _check_cpu_split(trainer.cpu_devices)
  else:
    partitioning.split_cpu(trainer.cpu_devices)
  if not _distributed_started():
    distributed.initialize(trainer.distributed)
  if jax.process_index() > 0:
    logging.set_verbosity(logging.WARNING)


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
