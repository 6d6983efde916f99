"""Tokenizes a source once into sharded TFRecord files plus a manifest.json.

Shard i of N holds the source's documents i, i+N, i+2N, ... (or whole files,
when there are at least N), so N workers write N shards independently. Each
finished shard is marked by a small `.done.json` written after its TFRecord
files, and the manifest comes last; a restarted run with the same arguments
keeps finished shards and redoes only the rest. One process at a time writes
a directory: it holds the directory's lock (locks.DirectoryLock) throughout.

Two engines write the shards: a process pool on this machine, or an Apache
Beam pipeline (beam_engine.py) for corpora no single machine can tokenize.
Both run the same functions on the same shard indices, so their shards and
manifest are the same bytes.
"""
import concurrent.futures
import contextlib
import fnmatch
import hashlib
import json
import multiprocessing
import os
import threading

from absl import logging
from etils import epath

from levanter_flax.core import lifetime, locks, paths, progress
from levanter_flax.core.lazy_tensorflow import import_tensorflow
from levanter_flax.data import sources
from levanter_flax.data.manifest import FORMAT_VERSION, MANIFEST
from levanter_flax.data.tokenizers import identity, load_tokenizer
from levanter_flax.core.errors import UserError
from levanter_flax.data import shards
from levanter_flax.data.shards import (ARGUMENTS, TOKENIZER_SAMPLE, TRAINED_TOKENIZER,
                                       PrepareOptions, chat_template,
                                       finished_shards, shard_record, tokenizer_sample,
                                       tokenizer_spec, train_tokenizer, write_manifest)

ENGINES = ("local", "beam")
DEFAULT_CACHE_DIR = "~/.cache/levanter_flax"


def _write_shard_task(args) -> tuple[int, dict]:
  return args[-1], shard_record(*args)


def _size_and_mtime(path: str) -> tuple[int, int]:
  """(bytes, modification time in ns): of the object's last upload, on gs://."""
  try:
    if paths.is_remote(path):
      stat = import_tensorflow().io.gfile.stat(path)
      return stat.length, stat.mtime_nsec
    stat = os.stat(path)
    return stat.st_size, stat.st_mtime_ns
  except Exception as e:  # pylint: disable=broad-except  # Gone since the glob matched it.
    raise UserError(f"cannot read input file {path}: {getattr(e, 'strerror', None) or e}") from e


def _input_fingerprint(options: PrepareOptions, files: list[str]) -> dict:
  """What identifies the input files' contents, from one stat() per file.

  Hashing the contents would read a TB-sized corpus in full on every start
  (hours, and again in every trainer process that asks for the built-in
  corpus); a stat is cheap however big the files. Sizes catch appended or
  truncated files, and the modification time (ns) an edit in place of the same
  size: every write sets it. A copy that does not keep mtimes (cp without -p)
  is then refused, which errs on the safe side. The stdlib corpus is left to
  its sizes: a reinstall of the same Python gives new mtimes to the same files.
  """
  stats = [_size_and_mtime(f) for f in files]
  listing = json.dumps([(f, size) for f, (size, _) in zip(files, stats)])
  fingerprint = {"input_files": hashlib.sha256(listing.encode()).hexdigest()}
  if options.source.kind != "stdlib":
    mtimes = json.dumps([mtime for _, mtime in stats])
    fingerprint["input_mtimes"] = hashlib.sha256(mtimes.encode()).hexdigest()
  return fingerprint


def _check_arguments(options: PrepareOptions, wanted: dict, record: bool) -> None:
  """Refuses to mix shards made with different arguments or inputs in one directory.

  With `record` (only under the directory's lock), a new directory's arguments
  are written down for the next run to compare.
  """
  path = options.output_dir / ARGUMENTS
  if not path.exists():
    if record:
      shards.write_json_atomically(path, wanted)
    return
  try:
    previous = json.loads(path.read_text())
    previous.pop("output_dir", None)  # Recorded by earlier versions.
  except (OSError, ValueError, AttributeError) as e:
    raise UserError(f"cannot read {path}: {e}; use a new --output_dir") from e
  if "input_mtimes" not in previous:  # Prepared before mtimes were recorded: sizes alone.
    wanted = {k: v for k, v in wanted.items() if k != "input_mtimes"}
  if "tokenizer_sample_bytes" in wanted and "tokenizer_sample_bytes" not in previous:
    if not record:  # Complete, its tokenizer trained on the whole train split.
      wanted = {k: v for k, v in wanted.items() if k != "tokenizer_sample_bytes"}
    else:
      raise UserError(f"{options.output_dir} was partly prepared by an older prepare, which "
                      f"trained its tokenizer otherwise; use a new --output_dir")
  changed = sorted(k for k in set(wanted) | set(previous) if wanted.get(k) != previous.get(k))
  if changed and record and not _has_work(options.output_dir):
    # An earlier try failed before it kept anything (a bad input line): nothing to mix with.
    shards.write_json_atomically(path, wanted)
    return
  if changed:
    raise UserError(f"{options.output_dir} was prepared with different arguments "
                    f"({', '.join(changed)}); use a new --output_dir")


# Every name a prepare (or its lock) writes in its directory.
_OWN_FILES = (locks.LOCK_FILE, MANIFEST, ARGUMENTS, TRAINED_TOKENIZER, TOKENIZER_SAMPLE,
              "train-*", "validation-*", "shard-*.done.json*", "*.tmp-*")


def _refuse_foreign(directory: epath.Path) -> None:
  """A directory that holds files no prepare wrote (an HF checkpoint's, say) is not written
  into: its files would be mixed with the dataset's, or taken for a dataset's."""
  if not directory.is_dir() or (directory / ARGUMENTS).exists():
    return
  foreign = sorted(p.name for p in directory.iterdir()  # .DS_Store, .gitkeep: not content.
                   if not p.name.startswith(".")
                   and not any(fnmatch.fnmatch(p.name, own) for own in _OWN_FILES))
  if foreign:
    raise UserError(f"{directory} is not empty and holds no dataset ({', '.join(foreign[:3])}"
                    f"{', ...' if len(foreign) > 3 else ''}): give --output_dir a new or empty "
                    f"directory")


def _has_work(directory: epath.Path) -> bool:
  """Whether a directory holds anything an earlier prepare finished: a shard, a tokenizer."""
  return (any(directory.glob("shard-*.done.json"))
          or any((directory / name).exists() for name in (TRAINED_TOKENIZER, TOKENIZER_SAMPLE)))


# What a killed writer leaves: each file is written under a temp name first
# (paths.write_atomically, tfrecord.ShardWriter; not on gs://, where objects
# appear whole), its own name + .tmp-<pid>.
_TEMP_FILES = ("train-*.tmp-*", "validation-*.tmp-*", "shard-*.done.json.tmp-*",
               *(f"{name}.tmp-*" for name in (MANIFEST, ARGUMENTS, TRAINED_TOKENIZER,
                                               TOKENIZER_SAMPLE)))


def _remove_temp_files(directory: epath.Path) -> None:
  """Deletes temp files of killed runs; only under the lock, where no writer is alive."""
  for pattern in _TEMP_FILES:
    for stale in directory.glob(pattern):
      if stale.exists():
        stale.unlink()


def _run_locally(options: PrepareOptions, files: list[str], train: bool) -> None:
  """The local engine: trains the tokenizer if asked, writes the shards, then the manifest."""
  if train:
    train_tokenizer(options, [tokenizer_sample(options, files, i)
                              for i in range(options.num_shards)])
  records = _run_shards(options, files, tokenizer_spec(options))
  write_manifest(options, len(files), tokenizer_spec(options), records)


def _run_shards(options: PrepareOptions, files: list[str], tokenizer_spec: str) -> list[dict]:
  """Every shard's done marker, in shard order; writes the shards that lack one."""
  tasks = [(options, files, tokenizer_spec, i) for i in range(options.num_shards)]
  finished = finished_shards(options)
  todo = [t for t in tasks if t[-1] not in finished]
  counts = multiprocessing.get_context("spawn").Array("d", 2)
  shards.count_written(counts)
  try:
    with progress.Progress(f"prepare {options.output_dir}", total=len(todo), unit="shards",
                           counters=("documents", "MB"), summary=True) as shown, \
        _showing_written(counts, shown):
      if options.num_workers > 1 and len(todo) > 1:
        _run_in_workers(options, todo, counts, shown)
      else:
        for task in todo:
          _write_shard_task(task)
          shown.advance(1)
  finally:
    shards.count_written(None)
  return [_write_shard_task(task)[1] for task in tasks]  # Those just written: read back.


@contextlib.contextmanager
def _showing_written(counts, shown: progress.Progress):
  """Copies the documents and bytes written, by this process and its workers, to the display
  every second."""
  stop = threading.Event()

  def copy() -> None:
    shown_documents = shown_bytes = 0.0
    while not stop.wait(1.0):
      with counts.get_lock():
        documents, text_bytes = counts[0], counts[1]
      shown.advance(documents=documents - shown_documents, MB=(text_bytes - shown_bytes) / 1e6)
      shown_documents, shown_bytes = documents, text_bytes

  copier = threading.Thread(target=copy, name="prepare progress", daemon=True)
  copier.start()
  try:
    yield
  finally:
    stop.set()
    copier.join()
    with counts.get_lock():  # The rest, so the closing line holds every document.
      shown.counts["documents"], shown.counts["MB"] = counts[0], counts[1] / 1e6


def _start_worker(parent_pid: int, counts) -> None:
  lifetime.die_with_parent(parent_pid)
  shards.count_written(counts)


def _run_in_workers(options: PrepareOptions, tasks: list, counts,
                    shown: progress.Progress) -> None:
  """Writes the shards in parallel; the first failure stops every worker.

  Spawned, not forked: the parent may hold jax or tokenizer threads. An
  executor, not a Pool: a worker that dies (kill -9, the OOM killer) breaks
  it, where a Pool would wait for that shard for ever.
  """
  with concurrent.futures.ProcessPoolExecutor(
      min(options.num_workers, len(tasks)), mp_context=multiprocessing.get_context("spawn"),
      # Killed with this process; the thread that starts a worker (the caller's, or the pool's
      # worker handler, for a replacement) lives as long as the pool.
      initializer=_start_worker, initargs=(os.getpid(), counts)) as pool:
    try:
      for done in concurrent.futures.as_completed([pool.submit(_write_shard_task, t) for t in tasks]):
        done.result()
        shown.advance(1)
    except BaseException as e:
      pool.shutdown(wait=False, cancel_futures=True)
      for worker in multiprocessing.active_children():  # Busy with other shards: not needed now.
        worker.terminate()
      if isinstance(e, concurrent.futures.BrokenExecutor):
        raise UserError(f"a prepare worker died (killed, or out of memory?) while writing "
                        f"{options.output_dir}; its finished shards are kept: run the same "
                        f"command again") from None
      raise


def prepare_dataset(options: PrepareOptions, wait: bool = False) -> epath.Path:
  """Writes the dataset unless it is already complete; returns its directory.

  While another process writes the directory, this one waits for it with
  `wait`, and is otherwise refused with a UserError naming it.
  """
  # The inputs first, so that a mistyped glob or tokenizer leaves no directory behind.
  files = sources.resolve_files(options.source, os.fspath(options.output_dir))
  if not options.train_tokenizer_vocab_size:
    load_tokenizer(options.tokenizer)
  wanted = options.arguments() | _input_fingerprint(options, files)
  _check_seq_len(options)
  if options.weighted:
    wanted |= _check_weighted(options)
  pipeline = None
  if options.engine == "beam":
    from levanter_flax.data import beam_engine  # pylint: disable=g-import-not-at-top  # Optional.
    pipeline = beam_engine.pipeline(options, len(files))
  if (options.output_dir / MANIFEST).exists():  # Complete and written last: no lock needed.
    _check_arguments(options, wanted, record=False)
    return options.output_dir
  _refuse_foreign(options.output_dir)
  paths.make_dirs(options.output_dir, "dataset directory")
  with locks.locked(options.output_dir, "dataset directory", wait=wait):
    _check_arguments(options, wanted, record=True)  # First: is this directory ours at all?
    _remove_temp_files(options.output_dir)
    if (options.output_dir / MANIFEST).exists():  # Finished by the process we waited for.
      return options.output_dir
    train = shards.tokenizer_to_train(options)
    if finished := len(finished_shards(options)):
      logging.info("Keeping %d finished shards in %s", finished, options.output_dir)
    if pipeline is not None:
      beam_engine.run(pipeline, options, files, train)
    else:
      _run_locally(options, files, train)
    manifest = json.loads((options.output_dir / MANIFEST).read_text())
  shards.log_summary(options, manifest)
  return options.output_dir


def _check_seq_len(options: PrepareOptions) -> None:
  """--seq_len: a preference source's, and only its."""
  kind = options.source.kind
  if (kind == "preference") != bool(options.seq_len):
    raise UserError("a preference source needs --seq_len, the model's config.model.seq_len: "
                    "each pair is one row" if kind == "preference" else
                    f"--seq_len is for --source=preference, not {kind}")
  if kind == "preference" and options.seq_len < 4:
    raise UserError(f"--seq_len {options.seq_len} holds no pair: a row holds an EOS and each "
                    f"reply with its EOS")


def _check_weighted(options: PrepareOptions) -> dict:
  """A chat, prompt_completion or preference source's own checks; what else decides its
  shards."""
  kind = options.source.kind
  if options.train_tokenizer_vocab_size:
    raise UserError(f"a {kind} source needs a given --tokenizer (with its chat template), not "
                    f"--train_tokenizer")
  tokenizer = load_tokenizer(options.tokenizer)
  if not hasattr(tokenizer, "encode_with_offsets"):
    raise UserError(f"a {kind} source needs a Hugging Face tokenizer.json or 'byte': "
                    f"--tokenizer {options.tokenizer} cannot say which characters each token "
                    f"covers, so the loss weights cannot be placed")
  if template := chat_template(options):
    return {"chat_template_sha256": template.sha256}
  if options.chat_template:
    raise UserError(f"--chat_template is for --source=chat or preference; {kind} joins prompt "
                    f"and completion as plain text")
  return {}


def builtin_directory(cache_dir: str, tokenizer: str, validation_fraction: float,
                      num_shards: int) -> epath.Path:
  """Where builtin_dataset keeps the corpus prepared with these settings."""
  tokenizer_id = identity(load_tokenizer(tokenizer))
  name = "-".join([sources.stdlib_name(),
                   tokenizer_id.kind + (f"-{tokenizer_id.sha256[:12]}" if tokenizer_id.sha256 else ""),
                   f"val{validation_fraction:g}", f"shards{num_shards}", f"v{FORMAT_VERSION}"])
  return paths.resolve(cache_dir or DEFAULT_CACHE_DIR, "config.data.cache_dir") / name


def builtin_dataset(cache_dir: str, tokenizer: str, validation_fraction: float,
                    num_shards: int) -> epath.Path:
  """The Python-stdlib corpus, prepared under `cache_dir` on first use.

  Every trainer process asks for it: one prepares it while the others wait.
  """
  directory = builtin_directory(cache_dir, tokenizer, validation_fraction, num_shards)
  if not (directory / MANIFEST).exists():
    logging.info("Tokenizing the Python stdlib corpus into %s", directory)
  return prepare_dataset(PrepareOptions(
      source=sources.SourceSpec(kind="stdlib"), output_dir=directory, tokenizer=tokenizer,
      num_shards=num_shards, validation_fraction=validation_fraction), wait=True)

