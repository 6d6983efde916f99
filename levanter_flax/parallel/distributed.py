"""Joining a multi-process run with jax.distributed, from the config or from the cluster.

Every process runs the same command. They meet at process 0's coordinator,
after which jax.devices() lists all processes' devices, and one jitted step
spans them. Set `trainer.distributed.*` explicitly, or leave the address
empty: on a TPU pod slice, a SLURM job of several tasks, or a Kubernetes
indexed Job, jax reads the coordinator, the process count and this process's
id from the cluster's environment.
"""
import dataclasses
import os
import socket
import sys
import threading
import time
from typing import Callable, TypeVar

import jax
import numpy as np
from absl import logging

from levanter_flax.core import checks
from levanter_flax.core.errors import UserError
from levanter_flax.core.schema import setting


def _device_ids(key: str, value) -> tuple[int, ...]:
  """"" (all), "0,1", 3 or [0, 1] -> a tuple of device ids."""
  try:
    if isinstance(value, str):
      return tuple(int(v) for v in value.split(",") if v.strip())
    return tuple(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))
  except (TypeError, ValueError):
    raise UserError(f"config key {key} must be device ids like \"0,1\" (\"\" for all); "
                    f"got {value!r}") from None

T = TypeVar("T")

@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """Set process 0's host:port, the process count and this process's id; or leave the address
  "" to detect a TPU pod slice, a SLURM job of several tasks or a Kubernetes indexed Job, and
  otherwise run as one process (config.trainer.distributed)."""
  coordinator_address: str = setting("", "host:port of process 0; \"\": detect a cluster, else "
                                     "run alone")
  num_processes: int = setting(0, "Processes in the run; 0: detect")
  process_id: int = setting(-1, "This process's id; -1: detect")
  local_device_ids: tuple[int, ...] = setting(
      (), "The local devices this process drives, e.g. \"0,1\"; \"\": all of the host's",
      convert=_device_ids, written="")
  initialization_timeout_seconds: int = setting(300, "How long to wait for every process")

  def __post_init__(self):
    checks.ranges(self, "trainer.distributed", {
        "num_processes": checks.at_least(0, "0: detect"),
        "process_id": checks.at_least(-1, "-1: detect")})


def detected_cluster() -> str:
  """The multi-process cluster this process runs in, by its environment; "" if none."""
  if int(os.environ.get("SLURM_NTASKS", "1")) > 1:
    return "SLURM"
  if "," in os.environ.get("TPU_WORKER_HOSTNAMES", "") or "MEGASCALE_COORDINATOR_ADDRESS" in os.environ:
    return "TPU pod"
  if "KUBERNETES_SERVICE_HOST" in os.environ and "JOB_COMPLETION_INDEX" in os.environ:
    return "Kubernetes indexed Job"
  return ""


def initialize(cfg: DistributedConfig) -> None:
  """Joins the run's other processes, or does nothing for a single-process run.

  Must come before anything touches a jax backend. A coordinator that cannot
  be reached, or processes that never all arrive, end the process with a
  one-line error after `initialization_timeout_seconds`, never a hang.
  """
  cluster = "" if cfg.coordinator_address else detected_cluster()
  if not cfg.coordinator_address and not cluster:
    return
  if cfg.coordinator_address:
    _check(cfg)
    if cfg.process_id > 0:
      _wait_for_coordinator(cfg.coordinator_address, cfg.initialization_timeout_seconds)
  # XLA:CPU needs an explicit collectives backend to span processes; GPUs and TPUs have their own.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  where = (f"the coordinator at {cfg.coordinator_address} as process {cfg.process_id} of "
           f"{cfg.num_processes}" if cfg.coordinator_address else f"the {cluster}'s coordinator")
  # When not every process registers in time, jax aborts the process from C++, which Python
  # cannot catch; this timer ends it first, with a message that says what to check.
  give_up = threading.Timer(cfg.initialization_timeout_seconds, _exit_with_error, [
      f"not every process joined {where} within {cfg.initialization_timeout_seconds} s "
      f"(config.trainer.distributed.initialization_timeout_seconds); check that all "
      f"processes were started, with the same num_processes and distinct process_ids"])
  give_up.daemon = True
  give_up.start()
  try:
    jax.distributed.initialize(
        coordinator_address=cfg.coordinator_address or None,
        num_processes=cfg.num_processes or None,
        process_id=cfg.process_id if cfg.process_id >= 0 else None,
        local_device_ids=list(cfg.local_device_ids) or None,
        initialization_timeout=cfg.initialization_timeout_seconds + _JAX_GRACE_SECONDS)
  except Exception as e:  # pylint: disable=broad-except  # XlaRuntimeError, ValueError, RuntimeError.
    text = str(e).strip()
    raise UserError(f"cannot join {where}: "
                    f"{text.splitlines()[0] if text else type(e).__name__}") from None
  finally:
    give_up.cancel()
  logging.info("Joined %s: %d local and %d global devices", where, jax.local_device_count(),
               jax.device_count())


# jax's own registration deadline comes this much after ours, so ours speaks first.
_JAX_GRACE_SECONDS = 30


def _exit_with_error(message: str) -> None:
  print(f"levanter_flax: error: {message}", file=sys.stderr, flush=True)
  os._exit(1)  # pylint: disable=protected-access  # The main thread is blocked inside jax.


def _wait_for_coordinator(address: str, timeout_seconds: float) -> None:
  """Polls process 0's port: an unreachable coordinator is named here, not by a C++ abort."""
  host, port = address.rsplit(":", 1)
  deadline = time.monotonic() + timeout_seconds
  while True:
    try:
      with socket.create_connection((host, int(port)), timeout=2):
        return
    except OSError as e:
      if time.monotonic() >= deadline:
        raise UserError(f"cannot reach the coordinator at {address} (process 0) within "
                        f"{timeout_seconds} s (config.trainer.distributed."
                        f"initialization_timeout_seconds): {e.strerror or e}") from None
      time.sleep(0.5)


def _check(cfg: DistributedConfig) -> None:
  if cfg.num_processes < 1:
    raise UserError(f"config.trainer.distributed.num_processes must be set (>= 1) with "
                    f"coordinator_address {cfg.coordinator_address!r}; got {cfg.num_processes}")
  if not 0 <= cfg.process_id < cfg.num_processes:
    raise UserError(f"config.trainer.distributed.process_id must be in [0, {cfg.num_processes}) "
                    f"for num_processes={cfg.num_processes}; got {cfg.process_id}")
  if cfg.initialization_timeout_seconds <= 0:
    raise UserError(f"config.trainer.distributed.initialization_timeout_seconds must be positive; "
                    f"got {cfg.initialization_timeout_seconds}")
  if ":" not in cfg.coordinator_address:
    raise UserError(f"config.trainer.distributed.coordinator_address must be host:port; "
                    f"got {cfg.coordinator_address!r}")


def agreed(action: Callable[[], T], what: str) -> T:
  """action()'s result on every process, or its UserError on every process.

  A start-up check that fails on one process alone (a damaged shard only it
  reads) would leave the others waiting in their next collective until jax
  gives up on it. One all-gather of who failed: the process that found the
  problem names it, the others point at its log.
  """
  result, error = None, None
  try:
    result = action()
  except UserError as e:
    error = e
  if jax.process_count() == 1:
    if error:
      raise error
    return result
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  failed = multihost_utils.process_allgather(np.int32(error is not None)).tolist()
  if error:
    raise error
  if any(failed):
    raise UserError(f"process {failed.index(1)} failed {what}; its log names the problem")
  return result
