"""Paths the user names: local and gs:// alike, through etils.epath.

Every file the project reads or writes under a user-given path goes through
an `epath.Path` from `resolve`. On gs:// it is TensorFlow's GCS filesystem
(epath's backend whenever TensorFlow is installed, as it is here), the one
tf.data reads TFRecords with; orbax writes arrays through tensorstore.

A gs:// path's bucket is checked once, before anything is created in it:
TensorFlow's makedirs retries a missing bucket forever, and a permission or
credentials problem would otherwise surface as a retry loop deep in orbax.
"""
import contextlib
import functools
import os
import shutil
import tempfile
from typing import Iterator, Union

from etils import epath

from levanter_flax.core.errors import UserError

PathLike = Union[str, os.PathLike]

# Bounds every request of the bucket check: a dead network or endpoint is one line, not a hang.
BUCKET_CHECK_SECONDS = 30.0
_SUPPORTED = ("gs://",)
_UNSUPPORTED = {"s3://": "TensorFlow 2.21 has no S3 filesystem and orbax hands only gs:// to "
                         "tensorstore; mount the bucket (e.g. mountpoint-s3) and pass the local "
                         "path (docs/build-notes.md)",
                "az://": "only local paths and gs:// are supported",
                "hf://": "only local paths and gs:// are supported; download the repository "
                         "and pass its local directory"}


def is_remote(path: PathLike) -> bool:
  return os.fspath(path).startswith(_SUPPORTED)


def resolve(value: PathLike, what: str) -> epath.Path:
  """A user-given path as an epath.Path, absolute; `what` names it (a flag or key) in errors.

  epath's own absolute() would turn gs://b into <cwd>/gs:/b, hence this once, at the edge.
  """
  text = os.fspath(value)
  for scheme, why in _UNSUPPORTED.items():
    if text.startswith(scheme):
      raise UserError(f"{what} {text}: {scheme} paths are not supported: {why}")
  if is_remote(text):
    check_bucket(text, what)
    # epath reads gs:// through TensorFlow: imported as the input pipeline does, off accelerators.
    from levanter_flax.core.lazy_tensorflow import import_tensorflow  # pylint: disable=g-import-not-at-top
    import_tensorflow()
    return epath.Path(text)
  return epath.Path(os.path.abspath(os.path.expanduser(text)))


def split_gcs(path: PathLike) -> tuple[str, str]:
  """gs://bucket/a/b -> ("bucket", "a/b")."""
  bucket, _, name = os.fspath(path)[len("gs://"):].partition("/")
  return bucket, name


def check_bucket(path: PathLike, what: str) -> None:
  """Raises a UserError naming `path` if its bucket is missing, forbidden or unreachable."""
  problem = _bucket_problem(split_gcs(path)[0])
  if problem:
    raise UserError(f"{what} {os.fspath(path)}: {problem}")


@functools.lru_cache(maxsize=None)
def _bucket_problem(bucket: str) -> str:
  """'' if objects in gs://<bucket> can be listed, else why not. Asked once per bucket."""
  # pylint: disable=g-import-not-at-top  # Only gs:// runs pay for these imports.
  from google.api_core import exceptions, retry
  from google.auth import exceptions as auth_exceptions
  from google.cloud import storage
  if not bucket:
    return "no bucket name after gs://"
  bounded = retry.Retry(timeout=BUCKET_CHECK_SECONDS)
  try:
    client = storage.Client()
    list(client.list_blobs(bucket, max_results=1, timeout=BUCKET_CHECK_SECONDS, retry=bounded))
  except auth_exceptions.DefaultCredentialsError:
    return ("no Google Cloud credentials: on a GCE or TPU VM they come from its service "
            "account; elsewhere run `gcloud auth application-default login` or set "
            "GOOGLE_APPLICATION_CREDENTIALS")
  except exceptions.NotFound:
    return f"the bucket gs://{bucket} does not exist"
  except (exceptions.Forbidden, exceptions.Unauthorized) as e:
    return f"permission denied on gs://{bucket} ({e.code}: {_first_line(e.message).split(': ')[-1]})"
  except (exceptions.GoogleAPIError, auth_exceptions.GoogleAuthError, OSError) as e:
    return (f"cannot reach Cloud Storage (gave up after {BUCKET_CHECK_SECONDS:.0f} s of "
            f"retries): {_first_line(str(e))}")
  return ""


def _first_line(text: str) -> str:
  return text.strip().splitlines()[0] if text.strip() else "no details"


def make_dirs(directory: epath.Path, what: str) -> epath.Path:
  """Creates `directory` if needed, or raises a UserError calling it `what`."""
  try:
    directory.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise UserError(f"cannot create {what} {directory}: {e.strerror or e}") from e
  if not is_remote(directory) and not os.access(directory, os.W_OK):
    raise UserError(f"{what} {directory} is not writable")
  return directory


def probe_writable(path: epath.Path, what: str) -> None:
  """Raises a UserError calling `path` `what` unless a file can be written beside it: known
  before long work whose result goes there (os.access can't tell, as root or on gs://)."""
  make_dirs(path.parent, f"{what}'s directory")
  probe = path.with_name(f".{path.name}.probe-{os.getpid()}")
  try:
    probe.write_text("")
    probe.unlink()
  except OSError as e:
    raise UserError(f"cannot write {what} {path}: {e.strerror or e}") from None


def write_atomically(path: epath.Path, data: Union[str, bytes]) -> None:
  """Readers see the old content or the new, never a part: a temp file, then a rename.

  On gs:// a single object write is already all-or-nothing, so it is written in place.
  """
  target = path if is_remote(path) else path.with_name(f"{path.name}.tmp-{os.getpid()}")
  try:
    (target.write_bytes if isinstance(data, bytes) else target.write_text)(data)
    if target != path:
      target.replace(path)
  finally:
    if target != path and target.exists():
      target.unlink()


def copy_tree(source: epath.Path, destination: epath.Path) -> None:
  """Copies the files under the directory `source` to `destination`, each local or gs://."""
  for root, _, files in source.walk():
    target = destination / os.fspath(root)[len(os.fspath(source)):].strip("/")
    target.mkdir(parents=True, exist_ok=True)
    for name in files:
      (epath.Path(root) / name).copy(target / name, overwrite=True)


@contextlib.contextmanager
def staged(directory: epath.Path) -> Iterator[epath.Path]:
  """A local directory to write into for writers that need real files (safetensors, the
  profiler): `directory` itself if local; for gs://, a temp dir copied there on success."""
  if not is_remote(directory):
    yield directory
    return
  local = tempfile.mkdtemp(prefix="levanter_flax-")
  try:
    yield epath.Path(local)
    copy_tree(epath.Path(local), directory)
  finally:
    shutil.rmtree(local, ignore_errors=True)


def real(path: epath.Path) -> epath.Path:
  """`path` with symlinks resolved where there are any (local paths)."""
  return path if is_remote(path) else epath.Path(os.path.realpath(path))


def move_tree(source: epath.Path, destination: epath.Path) -> None:
  """Renames a directory; on gs://, which has no directories, copies its files, then deletes.

  TensorFlow's own gs:// directory rename also moves the empty placeholder
  objects of subdirectories, which some servers refuse.
  """
  if not is_remote(source):
    source.rename(destination)
    return
  copy_tree(source, destination)
  source.rmtree()


@contextlib.contextmanager
def local_copy(source: epath.Path, pattern: str = "*") -> Iterator[epath.Path]:
  """A local directory holding `source`'s files that match `pattern`, for readers that need
  real files (safetensors maps them): `source` itself if local; for gs://, a temp copy."""
  if not is_remote(source):
    yield source
    return
  local = tempfile.mkdtemp(prefix="levanter_flax-")
  try:
    for file in source.glob(pattern):
      file.copy(epath.Path(local) / file.name)
    yield epath.Path(local)
  finally:
    shutil.rmtree(local, ignore_errors=True)
