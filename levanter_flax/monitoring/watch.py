"""Watching a run: a profiler window, memory figures and a hang watchdog."""
import contextlib
import dataclasses
import faulthandler
import os
import resource
import sys
import threading
import time
import traceback
from typing import Any

import jax
from absl import logging
from etils import epath

from levanter_flax.core import checks, paths
from levanter_flax.core.schema import setting


@dataclasses.dataclass(frozen=True)
class MonitoringConfig:
  """The profiler window and the hang watchdog (config.monitoring)."""
  profiler: bool = setting(False, "Trace steps [profiler_start_step, +profiler_num_steps) into the "
                           "workdir for TensorBoard's profile plugin")
  profiler_start_step: int = setting(5, "The first traced step: after compilation and warm-up")
  profiler_num_steps: int = setting(5, "Steps traced")
  hang_watchdog_seconds: float = setting(1800.0, "Log every thread's stack when no step finishes "
                                         "for this long (0: off)")

  def __post_init__(self):
    checks.positive(self, "monitoring", ("profiler_start_step", "profiler_num_steps"))
    checks.ranges(self, "monitoring", {"hang_watchdog_seconds": checks.at_least(0, "0: off")})


class ProfileWindow:
  """Traces steps [start_step, start_step + num_steps) with jax.profiler.

  The trace goes to <workdir>/plugins/profile/<time>/<host>.xplane.pb, the
  layout TensorBoard's profile plugin reads next to the run's scalars. Not
  clu's Profile action: that stops tracing without waiting for the device, so
  the window's last steps would be cut short. num_steps=0 traces nothing.
  The profiler writes local files only: for a gs:// workdir it traces into a
  temp dir that is copied there when the window ends. Python calls are not traced: on Python
  3.11 jax's Python tracer sets the profile hook of every running thread (the input pipeline's,
  orbax's, the compile thread's) from outside them, and a profiled run writing to gs:// died
  of a segfault in CI; the steps, the device and the trainer's annotations are traced.
  """

  def __init__(self, workdir: epath.Path, start_step: int, num_steps: int):
    self._workdir, self._first, self._last = workdir, start_step, start_step + num_steps - 1
    self._enabled, self._tracing = num_steps > 0, False
    self._staging = contextlib.ExitStack()

  def before_step(self, step: int) -> None:
    if self._enabled and step == self._first:
      options = jax.profiler.ProfileOptions()
      options.python_tracer_level = 0
      jax.profiler.start_trace(str(self._staging.enter_context(paths.staged(self._workdir))),
                               profiler_options=options)
      self._tracing = True

  def after_step(self, step: int, outputs: Any) -> None:
    if self._tracing and step >= self._last:
      self._stop(step, outputs)

  def close(self, step: int, outputs: Any) -> None:
    """Ends a window the run stopped inside (preempted, or its last step came first)."""
    if self._tracing:
      self._stop(step, outputs)

  def _stop(self, step: int, outputs: Any) -> None:
    jax.block_until_ready(outputs)
    jax.profiler.stop_trace()
    self._staging.close()
    self._tracing = False
    logging.info("Profile of steps %d-%d written to %s/plugins/profile; open it with "
                 "`tensorboard --logdir %s` (Profile tab, needs `pip install "
                 "tensorboard-plugin-profile`) or with xprof", self._first, step, self._workdir,
                 self._workdir)


def memory_metrics() -> dict[str, float]:
  """Host RSS, and device memory in use and at peak on the fullest local device.

  Device figures appear only where the backend reports memory_stats (GPU and
  TPU do; XLA:CPU does not).
  """
  metrics = {"memory/host_rss_bytes": float(host_rss_bytes())}
  stats = [s for s in (d.memory_stats() for d in jax.local_devices()) if s]
  if stats:
    metrics["memory/device_bytes_in_use"] = float(max(s.get("bytes_in_use", 0) for s in stats))
    metrics["memory/device_peak_bytes"] = float(max(s.get("peak_bytes_in_use", 0) for s in stats))
  return metrics


def host_rss_bytes() -> int:
  """The process's resident memory now (Linux), or its peak where /proc is missing."""
  try:
    with open("/proc/self/statm", encoding="ascii") as statm:
      return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
  except OSError:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS counts bytes, others KiB.


# The process's stderr, where absl logs: fd 2, whatever sys.stderr has been replaced with.
_STDERR = 2


class HangWatchdog:
  """Logs the stack of every thread when no step has finished for `timeout_seconds`.

  A hung collective, a stalled filesystem or a deadlocked input pipeline
  otherwise leaves a silent process. The dump repeats every `timeout_seconds`
  while the hang lasts, so one can see whether it moves. 0 turns it off.

  The watching thread needs the GIL, which a hang inside a C extension may
  hold. faulthandler's own thread needs none: armed for the same timeout and
  re-armed by the watching thread on each of its rounds, it writes the stacks
  to the process's stderr only when that thread could not run for so long.
  """

  def __init__(self, timeout_seconds: float):
    self._timeout = timeout_seconds
    self._last_step, self._last_time = 0, time.monotonic()
    self._stopped = threading.Event()
    self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)

  def __enter__(self) -> "HangWatchdog":
    if self._timeout:
      self._arm_backstop()
      self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._stopped.set()
    if self._thread.is_alive():
      self._thread.join()
      faulthandler.cancel_dump_traceback_later()

  def step_finished(self, step: int) -> None:
    self._last_step, self._last_time = step, time.monotonic()

  def _arm_backstop(self) -> None:
    faulthandler.dump_traceback_later(self._timeout, repeat=True, file=_STDERR)

  def _watch(self) -> None:
    while not self._stopped.wait(min(self._timeout, 10.0) / 4):
      self._arm_backstop()
      waited = time.monotonic() - self._last_time
      if waited >= self._timeout:
        logging.warning("Hang watchdog: no step finished for %.0f s since step %d "
                        "(config.monitoring.hang_watchdog_seconds=%g). Stacks of all threads:\n%s",
                        waited, self._last_step, self._timeout, all_thread_stacks())
        self._last_time = time.monotonic()


def all_thread_stacks() -> str:
  names = {thread.ident: thread.name for thread in threading.enumerate()}
  return "\n".join(f"Thread {names.get(ident, ident)}:\n{''.join(traceback.format_stack(frame))}"
                   for ident, frame in sys._current_frames().items())  # pylint: disable=protected-access
