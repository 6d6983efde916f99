"""Where documents come from: text files, JSON lines, Parquet, a TFDS dataset, or the stdlib;
chat, prompt/completion and preference records from JSON lines.

Each reader yields (key, text) pairs, or (key, Record) for the record kinds.
The key names the document (a path, file:line, or dataset index) in error
messages and decides its split, so the split does not depend on how many
workers read the source.
"""
import codecs
import contextlib
import dataclasses
import glob
import gzip
import io
import itertools
import json
import os
import pathlib
import re
import sys
import sysconfig
import warnings
from typing import BinaryIO, Callable, Iterator

import zstandard
from etils import epath

from levanter_flax.core import paths
from levanter_flax.core.lazy_tensorflow import import_tensorflow
from levanter_flax.core.errors import UserError

KINDS = ("stdlib", "text", "jsonl", "parquet", "tfds", "chat", "prompt_completion", "preference")
# JSON lines read whole, each turned into tokens with loss weights (chat.py, preference.py), not
# plain text.
RECORD_KINDS = ("chat", "prompt_completion", "preference")
DECODE_POLICIES = ("replace", "error")


@dataclasses.dataclass(frozen=True)
class SourceSpec:
  kind: str  # One of KINDS.
  inputs: tuple[str, ...] = ()  # File globs (text, jsonl, parquet); the dataset name (tfds).
  text_field: str = "text"  # jsonl, parquet and tfds: the feature holding the text.
  separator: str = ""  # text: split files into documents on this; "" = one per file.
  tfds_split: str = "train"
  tfds_data_dir: str = ""
  on_decode_error: str = "replace"  # Non-UTF-8 bytes: replace them, or stop.


@dataclasses.dataclass(frozen=True)
class Record:
  """A JSON-lines record of a record kind's source, and where it is (file:line)."""
  where: str
  fields: dict


# Skipped conversations named in prepare's warning and manifest; the rest are counted.
NAMED_SKIPS = 5


def _file_line(where: str) -> tuple[str, int]:
  path, _, line = where.rpartition(":")
  return path, int(line)


@dataclasses.dataclass
class SourceStats:
  documents: int = 0
  empty_documents_skipped: int = 0
  invalid_utf8_documents: int = 0
  conversations_without_assistant_skipped: int = 0  # chat: nothing to learn from them.
  # Where the first NAMED_SKIPS of them are (file:line), by file and line, so they can be fixed.
  conversations_without_assistant_first: list[str] = dataclasses.field(default_factory=list)
  pairs_too_long_skipped: int = 0  # preference: a pair longer than its row (--seq_len).

  def skip_conversation(self, where: str) -> None:
    """Counts a conversation without an assistant turn; a shard reads its files in order, so
    its first few are the earliest it holds."""
    self.conversations_without_assistant_skipped += 1
    if len(self.conversations_without_assistant_first) < NAMED_SKIPS:
      self.conversations_without_assistant_first.append(where)

  def add(self, other: "SourceStats") -> None:
    for field in dataclasses.fields(self):
      setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))
    # Each shard's earliest, merged: the earliest of all, whichever shard read them.
    self.conversations_without_assistant_first = sorted(
        self.conversations_without_assistant_first, key=_file_line)[:NAMED_SKIPS]


def skipped_conversations(stats: dict) -> str:
  """'N conversations without an assistant turn (a.jsonl:3, ... and M more)', of a SourceStats
  as a manifest's source records it."""
  count, named = (stats["conversations_without_assistant_skipped"],
                  stats["conversations_without_assistant_first"])
  more = f" and {count - len(named)} more" if count > len(named) else ""
  listed = f" ({', '.join(named)}{more})" if named else ""
  return f"{count} conversations without an assistant turn{listed}"


def stdlib_root() -> pathlib.Path:
  return pathlib.Path(sysconfig.get_paths()["stdlib"])


def stdlib_name() -> str:
  return f"stdlib-py{sys.version_info.major}.{sys.version_info.minor}"


def _stdlib_files() -> list[str]:
  """The stdlib's .py files, sorted. Installed packages are left out, so the corpus does not
  depend on what pip put there; their directories are not even walked, which makes this 40x
  faster than a glob of everything (every trainer start on the built-in corpus asks)."""
  files = []
  for directory, subdirectories, names in os.walk(stdlib_root()):
    subdirectories[:] = [d for d in subdirectories if d not in ("site-packages", "dist-packages")]
    files.extend(os.path.join(directory, name) for name in names if name.endswith(".py"))
  return sorted(files)


def decode_escapes(value: str, flag: str) -> str:
  r"""`value` with its backslash escapes ('\n', '\t', '\x0c', '\u2029') decoded.

  The unicode_escape codec reads its input as Latin-1 bytes, which garbles
  any other character ('§' becomes 'Â§'), so it sees only the ASCII runs.
  """
  decode = lambda match: codecs.decode(match.group(), "unicode_escape")
  try:
    with warnings.catch_warnings():  # An unknown escape ('\d') is refused, not kept.
      warnings.simplefilter("error", DeprecationWarning)
      return re.sub(r"[\x00-\x7f]+", decode, value)
  except (UnicodeDecodeError, DeprecationWarning) as e:
    # The warning's text is "decoding ... failed (DeprecationWarning: <reason>)".
    reason = getattr(e, "reason", None) or str(e).split("Warning: ")[-1].removesuffix(")")
    shown = value if value.isprintable() else repr(value)
    raise UserError(f"--{flag}={shown}: bad escape ({reason})") from None


def resolve_files(spec: SourceSpec, output_dir: str) -> list[str]:
  """The sorted input files every worker agrees on; names a glob that matches nothing.

  Files in `output_dir` are left out: a glob that reaches prepare's output
  directory would otherwise read its shards, and a rerun would see other inputs.
  """
  if spec.kind == "stdlib":
    return _stdlib_files()
  if spec.kind == "tfds":
    return []
  if not spec.inputs:
    raise UserError(f"a {spec.kind} source needs --input (a file or glob)")
  files = []
  for pattern in spec.inputs:
    found = _glob_files(pattern)
    matched = sorted(f for f in found if not _is_in(f, output_dir))
    if not matched:
      raise UserError(f"input glob {pattern!r} matches no files"
                      + (f" outside --output_dir {output_dir}" if found else ""))
    files.extend(matched)
  return files


def _is_in(path: str, directory: str) -> bool:
  if paths.is_remote(directory):
    return path.startswith(directory.rstrip("/") + "/")
  return os.path.realpath(path).startswith(os.path.join(os.path.realpath(directory), ""))


def _decode(raw: bytes, where: str, spec: SourceSpec, stats: SourceStats) -> str:
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError as e:
    if spec.on_decode_error == "error":
      raise UserError(f"{where}: invalid UTF-8 at byte {e.start}; pass --on_decode_error=replace "
                      f"to replace bad bytes with U+FFFD") from None
    stats.invalid_utf8_documents += 1
    return raw.decode("utf-8", errors="replace")


def _glob_files(pattern: str) -> list[str]:
  if not paths.is_remote(pattern):
    return [p for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p)]
  paths.check_bucket(pattern, "--input")
  gfile = import_tensorflow().io.gfile
  return [p for p in gfile.glob(pattern) if not gfile.isdir(p)]


# What a truncated or corrupt compressed file, or an I/O error, raises while it is read.
_READ_ERRORS = (OSError, EOFError, zstandard.ZstdError)


@contextlib.contextmanager
def _open(path: str) -> Iterator[BinaryIO]:
  """Local or gs://, decompressed as it is read if it ends in .gz or .zst."""
  with epath.Path(path).open("rb") as raw:
    if path.endswith(".gz"):
      with gzip.GzipFile(fileobj=raw) as unzipped:
        yield unzipped
    elif path.endswith(".zst"):
      reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
      with io.BufferedReader(reader) as unzipped:
        yield unzipped
    else:
      yield raw


def _read(path: str) -> bytes:
  try:
    with _open(path) as f:
      return f.read()
  except _READ_ERRORS as e:
    raise UserError(f"cannot read input file {path}: {e}") from e


class _SeekableGFile(io.RawIOBase):
  """TensorFlow's GFile (what epath opens gs:// with) as a standard raw file.

  pyarrow reads Parquet's footer first and then each row group by offset, so it
  needs seek, tell and closed, which GFile does not fully provide.
  """

  def __init__(self, gfile):
    super().__init__()
    self._gfile = gfile

  def readable(self) -> bool:
    return True

  def seekable(self) -> bool:
    return True

  def readinto(self, buffer) -> int:
    data = self._gfile.read(len(buffer))
    buffer[:len(data)] = data
    return len(data)

  def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
    self._gfile.seek(offset, whence)
    return self._gfile.tell()

  def tell(self) -> int:
    return self._gfile.tell()

  def close(self) -> None:
    self._gfile.close()
    super().close()


@contextlib.contextmanager
def _open_seekable(path: str) -> Iterator[BinaryIO]:
  with epath.Path(path).open("rb") as raw:
    if not paths.is_remote(path):
      yield raw
      return
    with io.BufferedReader(_SeekableGFile(raw), buffer_size=1 << 20) as buffered:
      yield buffered


def _parquet_documents(spec: SourceSpec, path: str, root: str, keep: Callable[[], bool],
                       stats: SourceStats) -> Iterator[tuple[str, str]]:
  """The text column of a Parquet file, one row group in memory at a time.

  A null is an empty document: skipped and counted, as an empty string is.
  """
  import pyarrow  # pylint: disable=g-import-not-at-top  # Only Parquet sources need it.
  from pyarrow import parquet  # pylint: disable=g-import-not-at-top
  relative = os.path.relpath(path, root)
  with _open_seekable(path) as raw:
    try:
      file = parquet.ParquetFile(raw)
    except (pyarrow.ArrowException, OSError) as e:
      raise UserError(f"cannot read Parquet file {path}: {e}") from None
    schema = file.schema_arrow
    if spec.text_field not in schema.names:
      raise UserError(f"{path}: Parquet file has no column {spec.text_field!r}; it has "
                      f"{schema.names} (set --text_field)")
    kind = schema.field(spec.text_field).type
    if not (pyarrow.types.is_string(kind) or pyarrow.types.is_large_string(kind)):
      raise UserError(f"{path}: column {spec.text_field!r} is {kind}, not a string")
    row = 0
    for group in range(file.num_row_groups):
      try:
        texts = file.read_row_group(group, columns=[spec.text_field]).column(0).to_pylist()
      except (pyarrow.ArrowException, OSError) as e:
        raise UserError(f"cannot read Parquet file {path}, row group {group}: {e}") from None
      for text in texts:
        if keep():
          yield f"{relative}:{row}", text or ""
        row += 1


def _jsonl_documents(spec: SourceSpec, path: str, root: str, keep: Callable[[], bool],
                     stats: SourceStats) -> Iterator[tuple[str, str]]:
  with _open(path) as f:
    for line_number, line in enumerate(f, 1):
      if not line.strip() or not keep():
        continue
      where = f"{path}:{line_number}"
      key = f"{os.path.relpath(path, root)}:{line_number}"
      try:
        record = json.loads(_decode(line, where, spec, stats))
      except json.JSONDecodeError as e:
        raise UserError(f"{where}: not valid JSON ({e.msg})") from None
      if spec.kind in RECORD_KINDS:
        if not isinstance(record, dict):
          raise UserError(f"{where}: a {spec.kind} record must be a JSON object")
        yield key, Record(where, record)
        continue
      if not isinstance(record, dict) or spec.text_field not in record:
        raise UserError(f"{where}: JSON record has no field {spec.text_field!r} "
                        f"(set --text_field)")
      if not isinstance(record[spec.text_field], str):
        raise UserError(f"{where}: field {spec.text_field!r} is "
                        f"{type(record[spec.text_field]).__name__}, not a string")
      yield key, record[spec.text_field]


def _file_documents(spec: SourceSpec, path: str, root: str, keep: Callable[[], bool],
                    stats: SourceStats) -> Iterator[tuple[str, str]]:
  """The documents of one input file that `keep()`, asked once per document in order, selects.

  Keys are relative to `root`, so moving the corpus does not change its split.
  """
  if spec.kind == "parquet":
    yield from _parquet_documents(spec, path, root, keep, stats)
    return
  if spec.kind in ("jsonl", *RECORD_KINDS):
    try:
      yield from _jsonl_documents(spec, path, root, keep, stats)
    except _READ_ERRORS as e:
      raise UserError(f"cannot read input file {path}: {e}") from None
    return
  key = os.path.relpath(path, root)
  if not spec.separator:
    if keep():
      yield key, _decode(_read(path), path, spec, stats)
    return
  # Every worker decodes the whole file to split it; each counts bad bytes in its own documents.
  text = _decode(_read(path), path, spec, SourceStats())
  for index, document in enumerate(text.split(spec.separator)):
    if keep():
      stats.invalid_utf8_documents += "\ufffd" in document and spec.on_decode_error == "replace"
      yield f"{key}#{index}", document


def _tfds_documents(spec: SourceSpec, part: int, num_parts: int,
                    stats: SourceStats) -> Iterator[tuple[str, str]]:
  import_tensorflow()
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  name = spec.inputs[0] if spec.inputs else ""
  try:
    dataset = tfds.load(name, split=spec.tfds_split, data_dir=spec.tfds_data_dir or None,
                        download=False, shuffle_files=False)
  except Exception as e:  # pylint: disable=broad-except  # tfds raises many kinds.
    first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise UserError(f"cannot load TFDS dataset {name!r} split {spec.tfds_split!r} from "
                    f"{spec.tfds_data_dir or 'the default data_dir'}: {first_line}") from None
  if spec.text_field not in dataset.element_spec:
    raise UserError(f"TFDS dataset {name!r} has no feature {spec.text_field!r}; it has "
                    f"{sorted(dataset.element_spec)} (set --text_field)")
  for index, example in enumerate(tfds.as_numpy(dataset.shard(num_parts, part))):
    key = f"{name}/{spec.tfds_split}/{index * num_parts + part}"
    yield key, _decode(example[spec.text_field], key, spec, stats)


def documents(spec: SourceSpec, files: list[str], part: int, num_parts: int,
              stats: SourceStats) -> Iterator[tuple[str, str]]:
  """This worker's 1/num_parts of the source's non-empty documents.

  With at least as many files as parts each worker reads whole files; with
  fewer (one big JSON-lines file) every worker reads every file and keeps
  every num_parts-th document.
  """
  if spec.kind == "tfds":
    selected = _tfds_documents(spec, part, num_parts, stats)
  else:
    root = str(stdlib_root()) if spec.kind == "stdlib" else os.path.commonpath(
        [os.path.dirname(os.path.abspath(f)) for f in files])
    if len(files) >= num_parts:
      selected = (doc for path in files[part::num_parts]
                  for doc in _file_documents(spec, path, root, lambda: True, stats))
    else:
      counter = itertools.count()
      keep = lambda: next(counter) % num_parts == part
      selected = (doc for path in files for doc in _file_documents(spec, path, root, keep, stats))
  for key, text in selected:
    if isinstance(text, Record):  # Counted once it is encoded (chat.Encoder may skip it).
      yield key, text
      continue
    if not text.strip():
      stats.empty_documents_skipped += 1
      continue
    stats.documents += 1
    yield key, text
