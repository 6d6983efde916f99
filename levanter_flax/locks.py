"""Exclusive locks on directories: one run per workdir, one writer per dataset directory.

A local lock is an advisory `flock` on `<directory>/.lock`. The kernel drops it
when its holder exits, however it exits (kill -9 included), so a lock left by
a dead process never blocks the next one; on NFS, flock is carried by the
server's locks, which it also frees when the holding node is lost. The file
is never deleted (that would let two processes lock two different files);
after locking, the holder writes who it is into it, so whoever is refused
can name the holder.

On gs:// there is no flock: the lock is the object `<directory>/.lock`, see
`_ObjectLease`.
"""
import contextlib
import datetime
import fcntl
import json
import os
import socket
import threading
import time
from typing import Iterator, Optional

from absl import logging
from etils import epath

from levanter_flax import paths
from levanter_flax.errors import UserError

LOCK_FILE = ".lock"


def _holder_description(path: epath.Path) -> str:
  try:
    holder = json.loads(path.read_text())
    return f"pid {holder['pid']} on {holder['host']} (since {holder['since']})"
  except (OSError, ValueError, KeyError, TypeError):  # Written a moment after locking.
    return "another process"


def _who() -> dict:
  return {"host": socket.gethostname(), "pid": os.getpid(),
          "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


class DirectoryLock:
  """Held while a process writes into `directory`; `what` names it in messages."""

  def __init__(self, directory: epath.Path, what: str):
    self.directory, self.what = directory, what
    self.path = directory / LOCK_FILE
    self._file = None
    self._lease = _ObjectLease(self.path) if paths.is_remote(directory) else None

  def try_acquire(self) -> bool:
    """Takes the lock if it is free; True if this process now holds it."""
    return self._lease.try_acquire() if self._lease else self._try_flock()

  def _try_flock(self) -> bool:
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
    try:
      self._file.seek(0)
      self._file.truncate()
      self._file.write(json.dumps(_who()))
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
    goes = (f"expires {_ObjectLease.LEASE_SECONDS} s after its holder stops renewing it"
            if self._lease else "goes when it exits")
    return UserError(f"{self.what} {self.directory} is in use by {self.holder()}; wait for it "
                     f"to finish or stop it (its lock, {self.path}, {goes})")

  def release(self) -> None:
    if self._lease:
      self._lease.release()
    if self._file is not None:
      self._file.close()  # Closing the descriptor drops the flock.
      self._file = None


@contextlib.contextmanager
def locked(directory: epath.Path, what: str, wait: bool = False) -> Iterator[DirectoryLock]:
  lock = DirectoryLock(directory, what)
  lock.acquire(wait)
  try:
    yield lock
  finally:
    lock.release()


@contextlib.contextmanager
def locked_for_job(directory: epath.Path, what: str) -> Iterator[None]:
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


class _ObjectLease:
  """A lock on Cloud Storage: an object created only if absent, renewed while held.

  Creating `path` with the precondition "generation 0" (no such object) is
  atomic: of two processes, one wins. The holder rewrites it every
  RENEW_SECONDS, each time on the precondition that it is still the version
  it wrote last. A holder killed with -9 cannot delete it, so a lock not
  renewed for LEASE_SECONDS (by the object's update time) is free, and so is
  one whose holder is a dead process on this host; it is taken over, again
  on the precondition of the version that was seen, so only one taker wins.
  Every request gives up after REQUEST_SECONDS of retries.
  """
  LEASE_SECONDS = 60
  RENEW_SECONDS = 15
  REQUEST_SECONDS = 30

  def __init__(self, path: epath.Path):
    from google.cloud import storage  # pylint: disable=g-import-not-at-top  # gs:// only.
    bucket, self._name = paths.split_gcs(path)
    self._path = path
    self._bucket = storage.Client().bucket(bucket)
    self._blob = None  # A new one per attempt: a used one reads the generation it last wrote.
    self._generation: Optional[int] = None
    self._holder = ""
    self._stop = threading.Event()
    self._renewer: Optional[threading.Thread] = None

  def _write(self, if_generation_match: int) -> bool:
    """Writes who holds it, if the object's generation is still the one given (0: absent)."""
    from google.api_core import exceptions, retry  # pylint: disable=g-import-not-at-top
    try:
      self._blob.upload_from_string(self._holder, if_generation_match=if_generation_match,
                                    timeout=self.REQUEST_SECONDS,
                                    retry=retry.Retry(timeout=self.REQUEST_SECONDS))
    except exceptions.PreconditionFailed:
      return False
    except exceptions.GoogleAPIError as e:
      raise UserError(f"cannot write the lock {self._path}: {e}") from None
    self._generation = self._blob.generation
    return True

  def try_acquire(self) -> bool:
    from google.api_core import exceptions  # pylint: disable=g-import-not-at-top
    self._holder = json.dumps(_who())
    self._blob = self._bucket.blob(self._name)
    if not self._write(if_generation_match=0):
      try:
        self._blob.reload(timeout=self.REQUEST_SECONDS)
      except exceptions.NotFound:  # Released just now.
        return self._write(if_generation_match=0) and self._start_renewing()
      if not self._abandoned() or not self._write(if_generation_match=self._blob.generation):
        return False
      logging.warning("Took over the lock %s of a holder that is gone", self._path)
    return self._start_renewing()

  def _abandoned(self) -> bool:
    age = datetime.datetime.now(datetime.timezone.utc) - self._blob.updated
    if age.total_seconds() > self.LEASE_SECONDS:
      return True
    try:
      holder = json.loads(self._blob.download_as_text(timeout=self.REQUEST_SECONDS))
      if holder["host"] != socket.gethostname():
        return False
      os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
      return True
    except Exception:  # pylint: disable=broad-except  # Unreadable, or alive: not ours to take.
      return False
    return False

  def _start_renewing(self) -> bool:
    self._stop.clear()
    self._renewer = threading.Thread(target=self._renew, name="lock-renewer", daemon=True)
    self._renewer.start()
    return True

  def _renew(self) -> None:
    while not self._stop.wait(self.RENEW_SECONDS):
      try:
        if not self._write(if_generation_match=self._generation):
          logging.error("Lost the lock %s: another process took it over after it went "
                        "unrenewed for %d s", self._path, self.LEASE_SECONDS)
          return
      except UserError as e:  # A storage hiccup: the lease has time left; try again.
        logging.warning("%s", e)

  def release(self) -> None:
    from google.api_core import exceptions  # pylint: disable=g-import-not-at-top
    if self._renewer is None:
      return
    self._stop.set()
    self._renewer.join()
    self._renewer = None
    try:
      self._blob.delete(if_generation_match=self._generation, timeout=self.REQUEST_SECONDS)
    except (exceptions.NotFound, exceptions.PreconditionFailed):  # Taken over meanwhile.
      pass
