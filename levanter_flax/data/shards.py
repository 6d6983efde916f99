"""One shard of a prepared dataset, written alike by both of prepare's engines (the local
process pool in dataset_writer.py, the Beam pipeline in beam_engine.py): its documents
tokenized, packed or kept as rows, and written as TFRecords with a `.done.json` mark; the BPE
trained on a sample; the manifest written last.
"""
import dataclasses
import json
import shlex
import zlib

from absl import logging
from etils import epath

from levanter_flax.core import paths
from levanter_flax.core.errors import UserError
from levanter_flax.data import chat, preference, sources, tfrecord
from levanter_flax.data.manifest import (FORMAT_VERSION, MANIFEST, PREFERENCE_FORMAT_VERSION,
                                         SPLITS, WEIGHTED_FORMAT_VERSION)
from levanter_flax.data.tokenizers import identity, load_tokenizer, train_bpe


ARGUMENTS = "prepare_args.json"
TRAINED_TOKENIZER = "tokenizer.json"
TOKENIZER_SAMPLE = "tokenizer_sample.json"  # What the trained tokenizer saw; goes into the manifest.


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

  def __post_init__(self):
    """Options that do not go together, named by prepare's flags."""
    if self.train_tokenizer_vocab_size and self.tokenizer != "byte":
      raise UserError("pass either --tokenizer or --train_tokenizer, not both")
    if self.beam_pipeline_options and self.engine != "beam":
      raise UserError("--beam_pipeline_options needs --engine=beam")
    if self.chat_template and self.source.kind not in ("chat", "preference"):
      raise UserError("--chat_template needs --source=chat or preference")

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


def split_pipeline_options(value: str) -> tuple[str, ...]:
  """--beam_pipeline_options, split as a shell would."""
  try:
    return tuple(shlex.split(value))
  except ValueError as e:
    raise UserError(f"--beam_pipeline_options={value}: {e}") from None


def is_validation(key: str, validation_fraction: float) -> bool:
  """A stable, order-independent split: a document's key alone decides it."""
  return zlib.crc32(key.encode("utf-8")) / 2**32 < validation_fraction


def _shard_name(split: str, index: int, num_shards: int) -> str:
  return f"{split}-{index:05d}-of-{num_shards:05d}.tfrecord"


def _done_name(index: int, num_shards: int) -> str:
  return f"shard-{index:05d}-of-{num_shards:05d}.done.json"


def write_json_atomically(path: epath.Path, value) -> None:
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


def count_written(counts) -> None:
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
  write_json_atomically(directory / _done_name(index, num_shards), done)
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
  write_json_atomically(options.output_dir / TOKENIZER_SAMPLE, {
      "rule": (f"the train documents of each of the {options.num_shards} shards' parts, in "
               f"order, until they reach {options.tokenizer_sample_bytes} / "
               f"{options.num_shards} bytes"),
      "documents": len(texts), "text_bytes": sum(len(t.encode("utf-8")) for t in texts)})
  train_bpe(texts, options.train_tokenizer_vocab_size, path)
  return str(path)


def tokenizer_to_train(options: PrepareOptions) -> bool:
  return bool(options.train_tokenizer_vocab_size) and not (
      options.output_dir / TRAINED_TOKENIZER).exists()


def tokenizer_spec(options: PrepareOptions) -> str:
  """The tokenizer the shards use: given, or trained into the output directory."""
  if options.train_tokenizer_vocab_size:
    return str(options.output_dir / TRAINED_TOKENIZER)
  return options.tokenizer


def write_manifest(options: PrepareOptions, num_files: int, tokenizer_spec: str,
                   done: list[dict]) -> dict:
  """Sums the shards' done markers (in shard order) into the manifest, written last."""
  tokenizer = identity(load_tokenizer(tokenizer_spec))
  stats = sources.SourceStats()
  for shard in done:
    stats.add(sources.SourceStats(**shard["stats"]))
  where = ", ".join(options.source.inputs) or options.source.kind
  if not stats.documents:
    discard_shards(options.output_dir)
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
      discard_shards(options.output_dir)
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
  write_json_atomically(options.output_dir / MANIFEST, manifest)
  return manifest


def log_summary(options: PrepareOptions, manifest: dict) -> None:
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


def discard_shards(directory: epath.Path) -> None:
  """Removes what a prepare wrote that can never become a dataset (no documents, or none in a
  split): every shard depends on the arguments that must change, and prepare_args.json would
  refuse the changed command. Only under the lock."""
  for pattern in ("train-*.tfrecord", "validation-*.tfrecord", "shard-*.done.json", ARGUMENTS,
                  TRAINED_TOKENIZER, TOKENIZER_SAMPLE):
    for path in directory.glob(pattern):
      path.unlink()
