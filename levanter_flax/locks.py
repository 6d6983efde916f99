"""Exclusive locks on directories: one run per workdir, one writer per dataset directory.

A lock is an advisory `flock` on `<directory>/.lock`. The kernel drops it
when its holder exits, however it exits (kill -9 included), so a lock left by
a dead process never blocks the next one; on NFS, flock is carried by the
server's locks, which it also frees when the holding node is lost. The file
is never deleted (that would let two processes lock two different files);
after locking, the holder writes who it is into it, so whoever is refused
can name the holder.
"""
import contextlib
import datetime
import fcntl
import json
import os
import pathlib
import socket
import time
from typing import Iterator

from absl import logging

from levanter_flax.errors import UserError

LOCK_FILE = ".lock"


def _holder_description(path: pathlib.Path) -> str:
  try:
    holder = json.loads(path.read_text())
    return f"pid {holder['pid']} on {holder['host']} (since {holder['since']})"
  except (OSError, ValueError, KeyError, TypeError):  # Written a moment after locking.
    return "another process"


class DirectoryLock:
  """Held while a process writes into `directory`; `what` names it in messages."""

  def __init__(self, directory: pathlib.Path, what: str):
    self.directory, self.what = directory, what
    self.path = directory / LOCK_FILE
    self._file = None

  def try_acquire(self) -> bool:
    """Takes the lock if it is free; True if this process now holds it."""
    try:
      self._file = open(self.path, "a+", encoding="utf-8")  # pylint: disable=consider-using-with
    except OSError as e:
      raise UserError(f"cannot create the lock file {self.path} of {self.what} "
                      f"{self.directory}: {e.strerror or e}") from None
    try:
      fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      self._file.close()
      self._file = None
      return False
    except OSError as e:  # Some FUSE mounts do not support flock at all.
      self._file.close()
      self._file = None
      raise UserError(f"cannot lock {self.path} of {self.what} {self.directory}: "
                      f"{e.strerror or e} (does this filesystem support flock?)") from None
    since = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    try:
      self._file.seek(0)
      self._file.truncate()
      self._file.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                   "since": since}))
      self._file.flush()
    except OSError:  # A full disk: the lock holds all the same, only its holder goes unnamed.
      pass
    return True

  def acquire(self, wait: bool = False, poll_seconds: float = 1.0) -> None:
    """Takes the lock, or raises a UserError naming its holder; with `wait`, waits for it."""
    announced = False
    while not self.try_acquire():
      if not wait:
        raise self.refusal()
      if not announced:
        logging.info("Waiting for %s, which holds %s", self.holder(), self.path)
        announced = True
      time.sleep(poll_seconds)

  def holder(self) -> str:
    return _holder_description(self.path)

  def refusal(self) -> UserError:
    return UserError(f"{self.what} {self.directory} is in use by {self.holder()}; wait for it "
                     f"to finish or stop it (its lock, {self.path}, goes when it exits)")

  def release(self) -> None:
    if self._file is not None:
      self._file.close()  # Closing the descriptor drops the flock.
      self._file = None


@contextlib.contextmanager
def locked(directory: pathlib.Path, what: str, wait: bool = False) -> Iterator[DirectoryLock]:
  lock = DirectoryLock(directory, what)
  lock.acquire(wait)
  try:
    yield lock
  finally:
    lock.release()


@contextlib.contextmanager
def locked_for_job(directory: pathlib.Path, what: str) -> Iterator[None]:
  """The lock, held by process 0 for every process of the job; all go on or stop together."""
  import jax  # pylint: disable=g-import-not-at-top  # Only trainers need it, not prepare's workers.
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  lock = DirectoryLock(directory, what)
  held = lock.try_acquire() if jax.process_index() == 0 else True
  if jax.process_count() > 1:  # Once, at the start of the job.
    held = bool(multihost_utils.broadcast_one_to_all(np.int32(held)))
  if not held:
    if jax.process_index() == 0:
      raise lock.refusal()
    raise UserError(f"{what} {directory} is in use by another run; process 0's log names it")
  try:
    yield
  finally:
    lock.release()
