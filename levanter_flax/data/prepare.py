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
import dataclasses
import hashlib
import json
import multiprocessing
import os
import threading
import zlib

from absl import logging
from etils import epath

from levanter_flax import lifetime, locks, paths, progress
from levanter_flax.data import chat, import_tensorflow, preference, sources, tfrecord
from levanter_flax.data.manifest import (FORMAT_VERSION, MANIFEST, PREFERENCE_FORMAT_VERSION,
                                         SPLITS, WEIGHTED_FORMAT_VERSION)
from levanter_flax.data.tokenizers import identity, load_tokenizer, train_bpe
from levanter_flax.errors import UserError

ARGUMENTS = "prepare_args.json"
TRAINED_TOKENIZER = "tokenizer.json"
TOKENIZER_SAMPLE = "tokenizer_sample.json"  # What the trained tokenizer saw; goes into the manifest.
ENGINES = ("local", "beam")
DEFAULT_CACHE_DIR = "~/.cache/levanter_flax"


@dataclasses.dataclass(frozen=True)
class PrepareOptions:
  source: sources.SourceSpec
  output_dir: epath.Path
  tokenizer: str = "byte"  # "byte" or a tokenizer file; see tokenizers.load_tokenizer.
  train_tokenizer_vocab_size: int = 0  # > 0: first train a BPE of this size on a sample.
  # The BPE's sample: each of the num_shards parts gives its first train documents up to
  # this many bytes / num_shards (see tokenizer_sample).
  tokenizer_sample_bytes: int = 1 << 30
  num_shards: int = 8
  validation_fraction: float = 0.01
  engine: str = "local"  # One of ENGINES.
  num_workers: int = 1  # local: processes; beam: the local runner's worker processes.
  beam_pipeline_options: tuple[str, ...] = ()  # Passed to Beam; see beam_engine.
  chat_template: str = ""  # chat: a Jinja file, instead of the tokenizer's own template.
  seq_len: int = 0  # preference: each pair is one row of this many tokens (EOS included).

  @property
  def weighted(self) -> bool:
    """Whether the shards carry loss weights (chat and instruction data)."""
    return self.source.kind in sources.RECORD_KINDS

  def arguments(self) -> dict:
    """What decides the shards' contents; a restart must repeat them exactly."""
    args = dataclasses.asdict(self)
    for where_and_how_fast in ("output_dir", "engine", "num_workers", "beam_pipeline_options"):
      del args[where_and_how_fast]
    if not self.train_tokenizer_vocab_size:
      del args["tokenizer_sample_bytes"]
    if not self.chat_template:  # As recorded before chat sources.
      del args["chat_template"]
    if not self.seq_len:  # As recorded before preference sources.
      del args["seq_len"]
    return json.loads(json.dumps(args))  # Tuples become lists, as they read back.


def is_validation(key: str, validation_fraction: float) -> bool:
  """A stable, order-independent split: a document's key alone decides it."""
  return zlib.crc32(key.encode("utf-8")) / 2**32 < validation_fraction


def _shard_name(split: str, index: int, num_shards: int) -> str:
  return f"{split}-{index:05d}-of-{num_shards:05d}.tfrecord"


def _done_name(index: int, num_shards: int) -> str:
  return f"shard-{index:05d}-of-{num_shards:05d}.done.json"


def _write_json_atomically(path: epath.Path, value) -> None:
  paths.write_atomically(path, json.dumps(value, indent=2))


def chat_template(options: PrepareOptions) -> chat.ChatTemplate | None:
  """The template a chat source is rendered with, and a preference source's conversations if
  it has one (else None: its conversational records are refused); None for other sources."""
  if options.source.kind == "preference" and not options.chat_template:
    try:
      return chat.load_template(options.tokenizer, "")
    except UserError:  # Only needed by conversational records, which say so.
      return None
  if options.source.kind not in ("chat", "preference"):
    return None
  return chat.load_template(options.tokenizer, options.chat_template)


def _encoded(options: PrepareOptions, tokenizer, documents, stats: sources.SourceStats):
  """(key, text, tokens, loss weights or None) per document; a conversation without an
  assistant turn is counted and left out."""
  if not options.weighted:
    for key, text in documents:
      yield key, text, tokenizer.encode(text), None
    return
  template = chat_template(options)
  if options.source.kind == "preference":
    encode = preference.PairEncoder(tokenizer, template, options.seq_len)
  else:
    encode = chat.Encoder(options.source.kind, tokenizer, template)
  for key, record in documents:
    encoded = encode(record.fields, record.where)
    if encoded is None and options.source.kind == "preference":
      stats.pairs_too_long_skipped += 1
    elif encoded is None:
      stats.skip_conversation(record.where)
    elif not encoded[0].strip():
      stats.empty_documents_skipped += 1
    else:
      stats.documents += 1
      yield key, *encoded


# What this process and its workers have written: [documents, text bytes]. A shared array
# (multiprocessing's, handed to each worker as it starts), read by the progress display.
_written = None
# Documents between updates of _written: each takes its lock.
_COUNT_EVERY = 256


def _count_written(counts) -> None:
  global _written
  _written = counts


def _add_written(documents: int, text_bytes: int) -> None:
  if _written is not None and documents:
    with _written.get_lock():
      _written[0] += documents
      _written[1] += text_bytes


def _write_shard(options: PrepareOptions, files: list[str], tokenizer_spec: str, index: int) -> dict:
  """Tokenizes this shard's documents into its train and validation TFRecord files.

  Returns what its done marker says. Rerun (a Beam retry), it writes the same bytes again.
  """
  tokenizer = load_tokenizer(tokenizer_spec)
  dtype = tfrecord.token_dtype(tokenizer.vocab_size)
  stats = sources.SourceStats()
  text_bytes = {"train": 0, "validation": 0}
  uncounted = [0, 0]  # Documents and text bytes not yet in _written.
  directory, num_shards = options.output_dir, options.num_shards
  documents = sources.documents(options.source, files, index, num_shards, stats)
  with tfrecord.ShardWriter(directory / _shard_name("train", index, num_shards), dtype,
                            options.weighted) as train, \
       tfrecord.ShardWriter(directory / _shard_name("validation", index, num_shards), dtype,
                            options.weighted) as val:
    for key, text, tokens, weights in _encoded(options, tokenizer, documents, stats):
      split = "validation" if is_validation(key, options.validation_fraction) else "train"
      (val if split == "validation" else train).write(tokens, weights)
      size = len(text.encode("utf-8"))
      text_bytes[split] += size
      uncounted = [uncounted[0] + 1, uncounted[1] + size]
      if uncounted[0] == _COUNT_EVERY:
        _add_written(*uncounted)
        uncounted = [0, 0]
  _add_written(*uncounted)
  done = {"stats": dataclasses.asdict(stats)}
  for split, writer in (("train", train), ("validation", val)):
    done[split] = {"file": writer.path.name, "num_documents": writer.num_documents,
                   "num_tokens": writer.num_tokens, "num_text_bytes": text_bytes[split],
                   "tokens_crc32c": writer.tokens_crc32c}
    if options.weighted:
      done[split] |= {"loss_weights_crc32c": writer.loss_weights_crc32c,
                      "num_loss_tokens": writer.num_loss_tokens}
  _write_json_atomically(directory / _done_name(index, num_shards), done)
  return done


def finished_shards(options: PrepareOptions) -> set[int]:
  return {i for i in range(options.num_shards)
          if (options.output_dir / _done_name(i, options.num_shards)).exists()}


def shard_record(options: PrepareOptions, files: list[str], tokenizer_spec: str, index: int) -> dict:
  """Shard `index`'s done marker: read back if a run before this one finished it, else written."""
  marker = options.output_dir / _done_name(index, options.num_shards)
  if marker.exists():
    return json.loads(marker.read_text())
  return _write_shard(options, files, tokenizer_spec, index)


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
      _write_json_atomically(path, wanted)
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
    _write_json_atomically(path, wanted)
    return
  if changed:
    raise UserError(f"{options.output_dir} was prepared with different arguments "
                    f"({', '.join(changed)}); use a new --output_dir")


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


def _discard_shards(directory: epath.Path) -> None:
  """Removes what a prepare wrote that can never become a dataset (no documents, or none in a
  split): every shard depends on the arguments that must change, and prepare_args.json would
  refuse the changed command. Only under the lock."""
  for pattern in ("train-*.tfrecord", "validation-*.tfrecord", "shard-*.done.json", ARGUMENTS,
                  TRAINED_TOKENIZER, TOKENIZER_SAMPLE):
    for path in directory.glob(pattern):
      path.unlink()


def tokenizer_sample(options: PrepareOptions, files: list[str], part: int) -> list[str]:
  """Part `part`'s share of the tokenizer's training text.

  Its train-split documents in order, until they reach tokenizer_sample_bytes
  / num_shards bytes (the last one may cross it). A rule of parts, not of
  whole-corpus order, so Beam workers sample the parts in parallel and the
  local engine gets the same sample. Reading stops at the budget: a TB corpus
  costs only the sample's bytes.
  """
  budget = -(-options.tokenizer_sample_bytes // options.num_shards)
  texts, size = [], 0
  for key, text in sources.documents(options.source, files, part, options.num_shards,
                                     sources.SourceStats()):
    if size >= budget:
      break
    if not is_validation(key, options.validation_fraction):
      texts.append(text)
      size += len(text.encode("utf-8"))
  return texts


def train_tokenizer(options: PrepareOptions, samples: list[list[str]]) -> str:
  """Trains the BPE on the parts' samples, in part order; returns its path as a tokenizer spec."""
  texts = [text for sample in samples for text in sample]
  logging.info("Training a %d-token byte-level BPE on %d documents sampled from %s",
               options.train_tokenizer_vocab_size, len(texts),
               ", ".join(options.source.inputs) or options.source.kind)
  path = options.output_dir / TRAINED_TOKENIZER
  # What it saw first, so that a finished tokenizer.json always has its record.
  _write_json_atomically(options.output_dir / TOKENIZER_SAMPLE, {
      "rule": (f"the train documents of each of the {options.num_shards} shards' parts, in "
               f"order, until they reach {options.tokenizer_sample_bytes} / "
               f"{options.num_shards} bytes"),
      "documents": len(texts), "text_bytes": sum(len(t.encode("utf-8")) for t in texts)})
  train_bpe(texts, options.train_tokenizer_vocab_size, path)
  return str(path)


def _tokenizer_to_train(options: PrepareOptions) -> bool:
  return bool(options.train_tokenizer_vocab_size) and not (
      options.output_dir / TRAINED_TOKENIZER).exists()


def tokenizer_spec(options: PrepareOptions) -> str:
  """The tokenizer the shards use: given, or trained into the output directory."""
  if options.train_tokenizer_vocab_size:
    return str(options.output_dir / TRAINED_TOKENIZER)
  return options.tokenizer


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
  _count_written(counts)
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
    _count_written(None)
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
  _count_written(counts)


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


def write_manifest(options: PrepareOptions, num_files: int, tokenizer_spec: str,
                   done: list[dict]) -> dict:
  """Sums the shards' done markers (in shard order) into the manifest, written last."""
  tokenizer = identity(load_tokenizer(tokenizer_spec))
  stats = sources.SourceStats()
  for shard in done:
    stats.add(sources.SourceStats(**shard["stats"]))
  where = ", ".join(options.source.inputs) or options.source.kind
  if not stats.documents:
    _discard_shards(options.output_dir)
    raise UserError(f"source {where} holds no non-empty documents "
                    f"({stats.empty_documents_skipped} empty ones skipped"
                    + (f", {sources.skipped_conversations(dataclasses.asdict(stats))}"
                       if options.source.kind == "chat" else "")
                    + (f", {stats.pairs_too_long_skipped} pairs longer than --seq_len "
                       f"{options.seq_len}" if options.source.kind == "preference" else "") + ")")
  splits = {split: [shard[split] for shard in done] for split in SPLITS}
  for split, shards in splits.items():
    if not sum(s["num_documents"] for s in shards) and (split == "train" or
                                                        options.validation_fraction > 0):
      _discard_shards(options.output_dir)
      raise UserError(f"source {where} gave no {split} documents out of {stats.documents}; "
                      f"adjust --validation_fraction ({options.validation_fraction}) and run "
                      f"again (this attempt's shards are removed)")
  version = WEIGHTED_FORMAT_VERSION if options.weighted else FORMAT_VERSION
  manifest = {
      "format_version": (PREFERENCE_FORMAT_VERSION if options.source.kind == "preference"
                         else version),
      "tokenizer": dataclasses.asdict(tokenizer),
      "token_dtype": tfrecord.token_dtype(tokenizer.vocab_size),
      "source": {**options.arguments()["source"], "num_input_files": num_files,
                 **dataclasses.asdict(stats)},
      "splits": splits,
  }
  if template := chat_template(options):
    manifest["chat_template"] = {"file": template.origin, "sha256": template.sha256}
  if options.source.kind == "preference":  # Each document is one pair, one row of the batch.
    manifest["seq_len"] = options.seq_len
  if options.train_tokenizer_vocab_size:
    manifest["tokenizer_training"] = json.loads((options.output_dir / TOKENIZER_SAMPLE).read_text())
  _write_json_atomically(options.output_dir / MANIFEST, manifest)
  return manifest


def _log_summary(options: PrepareOptions, manifest: dict) -> None:
  source, train = manifest["source"], manifest["splits"]["train"]
  logging.info("Prepared %s: %s documents, %s train tokens", options.output_dir,
               f"{source['documents']:,}", f"{sum(s['num_tokens'] for s in train):,}")
  if empty := sum(not shard["num_documents"] for shard in train):
    # The trainer's reader groups each read a fixed slice of the shards: a group whose shards
    # are all empty has no window to give, so fewer reader groups fit the data.
    logging.warning("Prepared %s: %d of its %d train shards are empty; --num_shards=%d or fewer "
                    "may fill every one", options.output_dir, empty, len(train),
                    len(train) - empty)
  if options.weighted:
    logging.info("Prepared %s: %s train tokens carry loss weight (%s)", options.output_dir,
                 f"{sum(s['num_loss_tokens'] for s in train):,}",
                 {"chat": "the assistant turns", "preference": "the replies"}.get(
                     options.source.kind, "the completions"))
  if skipped := source["pairs_too_long_skipped"]:
    logging.warning("Prepared %s: %d pairs longer than --seq_len %d were skipped",
                    options.output_dir, skipped, options.seq_len)
  if source["conversations_without_assistant_skipped"]:
    logging.warning("Prepared %s: skipped %s", options.output_dir,
                    sources.skipped_conversations(source))
  if source["invalid_utf8_documents"] or source["empty_documents_skipped"]:
    logging.warning("Prepared %s: %d documents had invalid UTF-8 (bad bytes replaced by U+FFFD), "
                    "%d empty documents were skipped (counts in its %s)", options.output_dir,
                    source["invalid_utf8_documents"], source["empty_documents_skipped"], MANIFEST)


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
  paths.make_dirs(options.output_dir, "dataset directory")
  with locks.locked(options.output_dir, "dataset directory", wait=wait):
    _check_arguments(options, wanted, record=True)  # First: is this directory ours at all?
    _remove_temp_files(options.output_dir)
    if (options.output_dir / MANIFEST).exists():  # Finished by the process we waited for.
      return options.output_dir
    train = _tokenizer_to_train(options)
    if finished := len(finished_shards(options)):
      logging.info("Keeping %d finished shards in %s", finished, options.output_dir)
    if pipeline is not None:
      beam_engine.run(pipeline, options, files, train)
    else:
      _run_locally(options, files, train)
    manifest = json.loads((options.output_dir / MANIFEST).read_text())
  _log_summary(options, manifest)
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

