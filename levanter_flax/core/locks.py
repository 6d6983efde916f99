"""Exclusive locks on directories: one run per workdir, one writer per dataset directory.

A local lock is an advisory `flock` on `<directory>/.lock`. The kernel drops it
when its holder exits, however it exits (kill -9 included), so a lock left by
a dead process never blocks the next one; on NFS, flock is carried by the
server's locks, which it also frees when the holding node is lost. The file
is never deleted (that would let two processes lock two different files);
after locking, the holder writes who it is into it, so whoever is refused
can name the holder.

On gs:// there is no flock: the lock is the object `<directory>/.lock`, a
lease renewed by a process of its own, see `_ObjectLease`. Unlike a flock, it
can be lost while its holder lives; a trainer asks before each write
(`JobLock`), and stops.
"""
import contextlib
import datetime
import fcntl
import json
import math
import os
import select
import signal
import socket
import subprocess
import sys
import time
import uuid
from typing import Iterator, Optional

from absl import logging
from etils import epath

from levanter_flax.core import paths
from levanter_flax.core.errors import UserError

LOCK_FILE = ".lock"


def _holder_description(path: epath.Path) -> str:
  try:
    return _describe(path.read_text())
  except OSError:
    return "another process"


def _describe(text: str) -> str:
  """Who holds a lock, from what its holder wrote into it."""
  try:
    holder = json.loads(text)
    return f"pid {holder['pid']} on {holder['host']} (since {holder['since']})"
  except (ValueError, KeyError, TypeError):  # A flock's file is written a moment after locking.
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
    self.remote = paths.is_remote(directory)
    self._lease = _ObjectLease(os.fspath(self.path)) if self.remote else None

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

  def lost(self, seen_within: float = 0.0) -> Optional[str]:
    """None while this process holds the lock, else what became of it; a flock is never lost.
    See _ObjectLease.lost for `seen_within`."""
    return self._lease.lost(seen_within) if self._lease else None

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
def locked_for_job(directory: epath.Path, what: str) -> Iterator["JobLock"]:
  """The lock, held by process 0 for every process of the job; all go on or stop together."""
  import jax  # pylint: disable=g-import-not-at-top  # Only trainers need it, not prepare's workers.
  lock = DirectoryLock(directory, what)
  held = _shared(lock.try_acquire() if jax.process_index() == 0 else True)
  if not held:
    if jax.process_index() == 0:
      raise lock.refusal()
    raise UserError(f"{what} {directory} is in use by another run; process 0's log names it")
  job_lock = JobLock(lock)
  try:
    yield job_lock
    job_lock.end()
  finally:
    lock.release()


def _shared(flag: bool) -> bool:
  """Process 0's `flag`, on every process; one broadcast, so call it at a point all reach."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  if jax.process_count() == 1:
    return flag
  return bool(multihost_utils.broadcast_one_to_all(np.int32(flag)))


# clu's progress reporter and the loop write a log step's metrics within milliseconds: one read
# of the lock object serves them all, and nothing later than this trusts an earlier read.
_ONE_LOG_STEP_SECONDS = 1.0


class JobLock:
  """A job's lock as its writers see it: asked before each write into the directory.

  A flock is never lost while its process lives, so on a local directory both
  questions cost nothing. A lease on gs:// can be lost (see `_ObjectLease`):
  process 0 then reads the lock object before each write, and once it is
  another run's, the job writes nothing more and stops with a UserError
  naming the new holder.

  Several processes must stop together: a process 0 that raised alone would
  leave the others waiting in the next step's collectives, and itself in
  jax's shutdown barrier, for minutes. So once process 0 finds the lock lost
  before a write of its own (metrics), it skips that write and every later
  one, and the job stops at its next checkpoint, a write of every process:
  `check_all` shares process 0's verdict there, one broadcast per checkpoint
  and none per step, and `end` once more for a job whose last step came
  first. The steps in between are computed and written nowhere. (jax's
  preemption service could stop them sooner, but a job that ends before
  every process joined its sync protocol waits out the protocol's 3-minute
  barrier at exit.)
  """

  def __init__(self, lock: DirectoryLock):
    self._lock = lock
    self._lost: Optional[str] = None  # Process 0: why the lock is no longer this job's.

  def may_write(self) -> bool:
    """Before a write of process 0 alone: whether to make it; one process raises instead."""
    import jax  # pylint: disable=g-import-not-at-top
    if jax.process_index() > 0:  # It holds nothing: process 0 decides for it in check_all.
      return True
    if self._lost is None:
      self._lost = self._lock.lost(seen_within=_ONE_LOG_STEP_SECONDS)
      if self._lost is None:
        return True
      if jax.process_count() > 1:
        logging.error("Lost %s %s: %s; writing nothing more, every process stops at the next "
                      "checkpoint", self._lock.what, self._lock.directory, self._lost)
    if jax.process_count() == 1:
      raise UserError(self._message())
    return False

  def check_all(self) -> None:
    """Before a write of every process: raises on every process once the lock is lost."""
    import jax  # pylint: disable=g-import-not-at-top
    if not self._lock.remote:
      return
    if jax.process_index() == 0 and self._lost is None:
      self._lost = self._lock.lost()
    self._stop_if_lost()

  def end(self) -> None:
    """At the job's end, on every process: a write that process 0 skipped fails the job."""
    if self._lock.remote:
      self._stop_if_lost()

  def _stop_if_lost(self) -> None:
    """Raises on every process if process 0 found the lock lost."""
    import jax  # pylint: disable=g-import-not-at-top
    if _shared(self._lost is not None):
      raise UserError(self._message() if jax.process_index() == 0 else
                      f"lost {self._lock.what} {self._lock.directory}: its lock is no longer "
                      f"this job's; process 0's log names the new holder")

  def _message(self) -> str:
    return (f"lost {self._lock.what} {self._lock.directory}: {self._lost}; stopped before "
            f"writing anything more")


# What an _ObjectLease hands its renewer process besides the object and its text.
_TIMINGS = ("LEASE_SECONDS", "RENEW_SECONDS", "RETRY_SECONDS", "REQUEST_SECONDS", "ATTEMPT_SECONDS")


class _ObjectLease:
  """A lock on Cloud Storage: an object created only if absent, renewed by a process of its own.

  Creating `path` with the precondition "generation 0" (no such object) is
  atomic: of two processes, one wins. What it holds (host, pid and start time
  of the holder, and a random id) is the lease's identity: the lock is ours
  exactly while the object holds that text.

  Renewing: a child process (`python -m levanter_flax.core.locks`, a new
  interpreter, never a fork of the trainer) rewrites the object every
  RENEW_SECONDS, each time on the precondition that it is still the version
  it wrote last. Not a thread: a thread needs the trainer's GIL, which
  TensorFlow's GCS uploads hold for long stretches, and a renewal starved
  past LEASE_SECONDS lets another run take the lock. A failed rewrite
  (storage unreachable, a timeout) is retried every RETRY_SECONDS: nobody
  else wrote, so the lease is still ours; a rewrite refused on its
  precondition is a loss only if the object no longer holds our text (a
  rewrite that timed out here may have landed there). The renewer deletes
  the object when its parent releases the lock or dies, however it dies:
  its stdin, a pipe from the parent, ends either way, as the kernel drops a
  flock.

  Checking: a lease can still be lost (storage unreachable for LEASE_SECONDS,
  the object replaced or deleted by hand). `lost()` reads the object, and the
  trainer asks before each write (JobLock), so a lost lock is noticed before
  anything more is written, with no renewal interval of delay; one small
  read per log step's metrics and per checkpoint, each of which uploads far
  more. A read that fails is no loss while the renewer runs. The
  renewer alone could only notice at its next renewal; the checks alone
  would leave a trainer starved of its GIL to lose the lock to a second run
  that then writes alongside it.

  Taking over: a holder killed with -9 together with its renewer cannot
  delete the object, so a lock not renewed for LEASE_SECONDS (by the
  object's update time) is free, and so is one whose holder is a dead
  process on this host; it is taken over on the precondition of the version
  that was seen, so only one taker wins. Every request gives up after
  REQUEST_SECONDS of attempts of at most ATTEMPT_SECONDS each.
  """
  LEASE_SECONDS = 60
  RENEW_SECONDS = 15
  RETRY_SECONDS = 1
  REQUEST_SECONDS = 30
  ATTEMPT_SECONDS = 10

  def __init__(self, path: str, holder: str = "", generation: Optional[int] = None):
    from google.cloud import storage  # pylint: disable=g-import-not-at-top  # gs:// only.
    bucket, self._name = paths.split_gcs(path)
    self._path = path
    self._bucket = storage.Client().bucket(bucket)
    self._holder, self._generation = holder, generation
    self._renewer: Optional[subprocess.Popen] = None
    self._seen_ours_at = -math.inf  # When lost() last read our text in the object.

  def _requests(self) -> dict:
    from google.cloud.storage import retry  # pylint: disable=g-import-not-at-top
    return {"timeout": self.ATTEMPT_SECONDS,
            "retry": retry.DEFAULT_RETRY.with_timeout(self.REQUEST_SECONDS)}

  def _write(self, if_generation_match: int) -> bool:
    """Writes our text if the object's generation is still the one given (0: absent)."""
    from google.api_core import exceptions  # pylint: disable=g-import-not-at-top
    blob = self._bucket.blob(self._name)
    try:
      blob.upload_from_string(self._holder, if_generation_match=if_generation_match,
                              **self._requests())
    except exceptions.PreconditionFailed:
      return False
    except _storage_errors() as e:
      raise UserError(f"cannot write the lock {self._path}: {e}") from None
    self._generation = blob.generation
    return True

  def _read(self) -> tuple[Optional[str], int]:
    """(the object's text, its generation); (None, 0) if there is none."""
    from google.api_core import exceptions  # pylint: disable=g-import-not-at-top
    blob = self._bucket.blob(self._name)
    try:
      return blob.download_as_text(**self._requests()), blob.generation
    except exceptions.NotFound:
      return None, 0
    except _storage_errors() as e:
      raise UserError(f"cannot read the lock {self._path}: {e}") from None

  def try_acquire(self) -> bool:
    from google.api_core import exceptions  # pylint: disable=g-import-not-at-top
    # A random id too: two leases of one process in one second must differ.
    self._holder = json.dumps({**_who(), "lease": uuid.uuid4().hex})
    for _ in range(3):  # Each pass may see the object change: released, renewed, taken over.
      if self._write(if_generation_match=0):
        return self._start_renewer()
      blob = self._bucket.blob(self._name)
      try:
        blob.reload(**self._requests())
      except exceptions.NotFound:  # Released just now.
        continue
      except _storage_errors() as e:
        raise UserError(f"cannot read the lock {self._path}: {e}") from None
      if not self._abandoned(blob):
        return False
      if self._write(if_generation_match=blob.generation):
        logging.warning("Took over the lock %s of a holder that is gone", self._path)
        return self._start_renewer()
    return False

  def _abandoned(self, blob) -> bool:
    """Whether the lock may be taken: unrenewed for LEASE_SECONDS, or its holder a dead process
    on this host, or us (our create landed, but its answer was lost and its retry refused)."""
    age = datetime.datetime.now(datetime.timezone.utc) - blob.updated
    if age.total_seconds() > self.LEASE_SECONDS:
      return True
    try:
      text = self._read()[0]
      if text == self._holder:
        return True
      holder = json.loads(text)
      if holder["host"] != socket.gethostname():
        return False
      os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
      return True
    except Exception:  # pylint: disable=broad-except  # Unreadable, or alive: not ours to take.
      return False
    return False

  def _start_renewer(self) -> bool:
    settings = {"path": self._path, "holder": self._holder, "generation": self._generation,
                **{k: getattr(self, k) for k in _TIMINGS}}
    # The same levanter_flax as this process's, wherever it was imported from.
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    python_path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    self._renewer = subprocess.Popen(  # pylint: disable=consider-using-with
        [sys.executable, "-m", "levanter_flax.core.locks", json.dumps(settings)],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": python_path})
    return True

  def lost(self, seen_within: float = 0.0) -> Optional[str]:
    """None while the object holds our text and is renewed; else what became of the lock.

    A read that found it ours less than `seen_within` seconds ago stands while the renewer
    runs: one log step's several metrics writes cost one read. A read that fails (the
    storage unreachable for REQUEST_SECONDS) is no loss while the renewer runs.
    """
    status = self._renewer.poll()
    if status is None and time.monotonic() - self._seen_ours_at < seen_within:
      return None
    try:
      text, _ = self._read()
    except UserError as e:
      if status is None:
        logging.warning("%s; still held while its renewer runs, asked again at the next write", e)
        return None
      text = self._holder
    if text is None:
      return f"its lock {self._path} was deleted"
    if text != self._holder:
      return f"{_describe(text)} took over its lock {self._path}"
    if status is not None:
      return (f"the process renewing its lock {self._path} (pid {self._renewer.pid}) exited "
              f"with status {status}, so the lock would expire")
    self._seen_ours_at = time.monotonic()
    return None

  def release(self) -> None:
    if self._renewer is None:
      return
    self._renewer.stdin.close()  # It deletes the object if it is still ours, and exits.
    try:
      self._renewer.wait(timeout=2 * self.REQUEST_SECONDS)
    except subprocess.TimeoutExpired:  # Storage unreachable: the lock expires on its own.
      self._renewer.kill()
      self._renewer.wait()
    self._renewer = None

  def keep_until_released(self) -> None:
    """The renewer process: renews until its stdin ends, then deletes the object if it is ours."""
    next_renewal = time.monotonic() + self.RENEW_SECONDS
    while not _ended(sys.stdin, max(0.0, next_renewal - time.monotonic())):
      try:
        renewed = self._renew()
      except Exception as e:  # pylint: disable=broad-except  # Whatever the storage client raised.
        logging.warning("Lock renewer: cannot renew the lock %s, retrying in %g s: %s",
                        self._path, self.RETRY_SECONDS, e)
        next_renewal = time.monotonic() + self.RETRY_SECONDS
        continue
      if not renewed:  # The trainer names the new holder before its next write.
        logging.error("Lock renewer: the lock %s is no longer this run's", self._path)
        return
      next_renewal = time.monotonic() + self.RENEW_SECONDS
    self._delete()

  def _renew(self) -> bool:
    """Rewrites the object on the precondition of our last version; False if it is not ours."""
    while not self._write(if_generation_match=self._generation):
      self._generation = self._own_generation()
      if self._generation is None:
        return False
    return True

  def _own_generation(self) -> Optional[int]:
    """The object's generation if it holds our text (a rewrite of ours may have landed unseen)."""
    text, generation = self._read()
    return generation if text == self._holder else None

  def _delete(self) -> None:
    from google.api_core import exceptions  # pylint: disable=g-import-not-at-top
    try:
      while self._generation is not None:
        try:
          self._bucket.blob(self._name).delete(if_generation_match=self._generation,
                                               **self._requests())
          return
        except exceptions.NotFound:
          return
        except exceptions.PreconditionFailed:
          self._generation = self._own_generation()
    except Exception as e:  # pylint: disable=broad-except  # It expires on its own.
      logging.warning("Lock renewer: cannot delete the lock %s (it expires %d s after its last "
                      "renewal): %s", self._path, self.LEASE_SECONDS, e)


def _storage_errors() -> tuple[type[Exception], ...]:
  """What a google-cloud-storage request raises once its retries are spent."""
  import requests  # pylint: disable=g-import-not-at-top  # gs:// only, like the client.
  from google.api_core import exceptions  # pylint: disable=g-import-not-at-top
  from google.auth import exceptions as auth_exceptions  # pylint: disable=g-import-not-at-top
  return exceptions.GoogleAPIError, requests.RequestException, auth_exceptions.GoogleAuthError


def _ended(stream, timeout: float) -> bool:
  """Whether `stream`, a pipe nobody writes to, ended (was closed) within `timeout` seconds."""
  readable, _, _ = select.select([stream], [], [], timeout)
  return bool(readable) and not os.read(stream.fileno(), 1)


if __name__ == "__main__":  # The renewer process of an _ObjectLease.
  # Its parent decides when the lease ends: a Ctrl-C, SIGTERM or a closed terminal's SIGHUP to
  # the process group is for the parent to handle (with a last checkpoint, under the lock).
  for _signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(_signum, signal.SIG_IGN)
  _settings = json.loads(sys.argv[1])
  _lease = _ObjectLease(_settings.pop("path"), _settings.pop("holder"), _settings.pop("generation"))
  for _timing, _seconds in _settings.items():
    setattr(_lease, _timing, _seconds)
  _lease.keep_until_released()
