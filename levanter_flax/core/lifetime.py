"""Child processes that end with the process that started them, even when it is killed (-9).

Otherwise the children of a killed parent run on for nobody: prepare's
workers write shards for hours, a launcher's units train outside its
--max_parallel. Linux only (PR_SET_PDEATHSIG); elsewhere they may outlive it.
"""
import ctypes
import functools
import os
import signal
import sys
from typing import Callable


_PR_SET_PDEATHSIG = 1  # From <linux/prctl.h>.


@functools.cache
def _libc() -> ctypes.CDLL:
  return ctypes.CDLL(None, use_errno=True)


def die_with_parent(parent_pid: int, signum: int = signal.SIGKILL) -> None:
  """Called in a child: it gets `signum` when its parent `parent_pid` dies.

  The signal fires when the thread that started the child exits, so that
  thread must live as long as the parent (its main thread, or a pool's own).
  """
  if not sys.platform.startswith("linux"):
    return
  if _libc().prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
    # Not absl's logging, whose locks another thread of the parent may have held at the fork.
    os.write(2, f"prctl(PR_SET_PDEATHSIG) failed (errno {ctypes.get_errno()}): this process may "
                f"outlive its parent\n".encode())
  # A parent that died before the prctl never signals: we were adopted by another process.
  if os.getppid() != parent_pid:
    os._exit(1)  # pylint: disable=protected-access


def ends_with_this_process(signum: int) -> Callable[[], None]:
  """A subprocess.Popen preexec_fn: the child gets `signum` when this process dies.

  libc is loaded here, before the fork, so that the child (whose one thread may have been
  copied while another held the loader's lock) only calls into it.
  """
  if sys.platform.startswith("linux"):
    _libc()
  return functools.partial(die_with_parent, os.getpid(), signum)
