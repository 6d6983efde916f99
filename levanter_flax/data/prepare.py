"""Tokenizes a source once into sharded TFRecord files plus a manifest.json.

Shard i of N holds the source's documents i, i+N, i+2N, ... (or whole files,
when there are at least N), so N workers write N shards independently. Each
finished shard is marked by a small `.done.json` written after its TFRecord
files, and the manifest comes last; a restarted run with the same arguments
keeps finished shards and redoes only the rest.
"""
import dataclasses
import hashlib
import json
import multiprocessing
import os
import pathlib
import zlib

from absl import logging

from levanter_flax.data import sources, tfrecord
from levanter_flax.data.tokenizers import TokenizerIdentity, identity, load_tokenizer, train_bpe
from levanter_flax.errors import UserError, ensure_writable_dir

FORMAT_VERSION = 2
MANIFEST = "manifest.json"
ARGUMENTS = "prepare_args.json"
TRAINED_TOKENIZER = "tokenizer.json"
DEFAULT_CACHE_DIR = "~/.cache/levanter_flax"


@dataclasses.dataclass(frozen=True)
class PrepareOptions:
  source: sources.SourceSpec
  output_dir: pathlib.Path
  tokenizer: str = "byte"  # "byte" or a tokenizer file; see tokenizers.load_tokenizer.
  train_tokenizer_vocab_size: int = 0  # > 0: first train a BPE of this size on the train split.
  num_shards: int = 8
  validation_fraction: float = 0.01
  num_workers: int = 1

  def arguments(self) -> dict:
    """What decides the shards' contents; a restart must repeat them exactly."""
    args = dataclasses.asdict(self)
    args["output_dir"] = str(self.output_dir)
    del args["num_workers"]
    return json.loads(json.dumps(args))  # Tuples become lists, as they read back.


def is_validation(key: str, validation_fraction: float) -> bool:
  """A stable, order-independent split: a document's key alone decides it."""
  return zlib.crc32(key.encode("utf-8")) / 2**32 < validation_fraction


def _shard_name(split: str, index: int, num_shards: int) -> str:
  return f"{split}-{index:05d}-of-{num_shards:05d}.tfrecord"


def _done_name(index: int, num_shards: int) -> str:
  return f"shard-{index:05d}-of-{num_shards:05d}.done.json"


def _write_json_atomically(path: pathlib.Path, value) -> None:
  tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
  tmp.write_text(json.dumps(value, indent=2))
  os.replace(tmp, path)


def _write_shard(options: PrepareOptions, files: list[str], tokenizer_spec: str, index: int) -> None:
  """Tokenizes this shard's documents into its train and validation TFRecord files."""
  tokenizer = load_tokenizer(tokenizer_spec)
  dtype = tfrecord.token_dtype(tokenizer.vocab_size)
  stats = sources.SourceStats()
  text_bytes = {"train": 0, "validation": 0}
  directory, num_shards = options.output_dir, options.num_shards
  with tfrecord.ShardWriter(directory / _shard_name("train", index, num_shards), dtype) as train, \
       tfrecord.ShardWriter(directory / _shard_name("validation", index, num_shards), dtype) as val:
    for key, text in sources.documents(options.source, files, index, num_shards, stats):
      split = "validation" if is_validation(key, options.validation_fraction) else "train"
      (val if split == "validation" else train).write(tokenizer.encode(text))
      text_bytes[split] += len(text.encode("utf-8"))
  done = {"stats": dataclasses.asdict(stats)}
  for split, writer in (("train", train), ("validation", val)):
    done[split] = {"file": writer.path.name, "num_documents": writer.num_documents,
                   "num_tokens": writer.num_tokens, "num_text_bytes": text_bytes[split]}
  _write_json_atomically(directory / _done_name(index, num_shards), done)


def _write_shard_task(args) -> int:
  _write_shard(*args)
  return args[-1]


def _check_arguments(options: PrepareOptions, files: list[str]) -> None:
  """Refuses to mix shards made with different arguments or inputs in one directory."""
  path = options.output_dir / ARGUMENTS
  listing = json.dumps([(f, os.path.getsize(f)) for f in files])
  wanted = options.arguments() | {"input_files": hashlib.sha256(listing.encode()).hexdigest()}
  if path.exists():
    previous = json.loads(path.read_text())
    changed = sorted(k for k in set(wanted) | set(previous) if wanted.get(k) != previous.get(k))
    if changed:
      raise UserError(f"{options.output_dir} was prepared with different arguments "
                      f"({', '.join(changed)}); use a new --output_dir")
  else:
    _write_json_atomically(path, wanted)


def _tokenizer_spec(options: PrepareOptions, files: list[str]) -> str:
  """The tokenizer to use, training one into the output directory first if asked."""
  if not options.train_tokenizer_vocab_size:
    return options.tokenizer
  path = options.output_dir / TRAINED_TOKENIZER
  if not path.exists():
    logging.info("Training a %d-token byte-level BPE on %s", options.train_tokenizer_vocab_size,
                 ", ".join(options.source.inputs) or options.source.kind)
    texts = (text for key, text in sources.documents(options.source, files, 0, 1,
                                                     sources.SourceStats())
             if not is_validation(key, options.validation_fraction))
    train_bpe(texts, options.train_tokenizer_vocab_size, path)
  return str(path)


def _run_shards(options: PrepareOptions, files: list[str], tokenizer_spec: str) -> None:
  todo = [i for i in range(options.num_shards)
          if not (options.output_dir / _done_name(i, options.num_shards)).exists()]
  if len(todo) < options.num_shards:
    logging.info("Keeping %d finished shards in %s", options.num_shards - len(todo),
                 options.output_dir)
  for index in todo:  # Temp files of a killed run, never renamed into place.
    for split in ("train", "validation"):
      for stale in options.output_dir.glob(_shard_name(split, index, options.num_shards) + ".tmp-*"):
        stale.unlink()
  tasks = [(options, files, tokenizer_spec, i) for i in todo]
  if options.num_workers <= 1 or len(tasks) <= 1:
    for task in tasks:
      _write_shard_task(task)
    return
  # Spawned, not forked: the parent may hold jax or tokenizer threads.
  context = multiprocessing.get_context("spawn")
  with context.Pool(min(options.num_workers, len(tasks))) as pool:
    for finished in pool.imap_unordered(_write_shard_task, tasks):
      logging.info("Wrote shard %d of %d", finished + 1, options.num_shards)


def _write_manifest(options: PrepareOptions, tokenizer: TokenizerIdentity, num_files: int) -> dict:
  done = [json.loads((options.output_dir / _done_name(i, options.num_shards)).read_text())
          for i in range(options.num_shards)]
  stats = sources.SourceStats()
  for shard in done:
    stats.add(sources.SourceStats(**shard["stats"]))
  where = ", ".join(options.source.inputs) or options.source.kind
  if not stats.documents:
    raise UserError(f"source {where} holds no non-empty documents "
                    f"({stats.empty_documents_skipped} empty ones skipped)")
  splits = {split: [shard[split] for shard in done] for split in ("train", "validation")}
  for split, shards in splits.items():
    if not sum(s["num_documents"] for s in shards) and (split == "train" or
                                                        options.validation_fraction > 0):
      raise UserError(f"source {where} gave no {split} documents out of {stats.documents}; "
                      f"adjust --validation_fraction ({options.validation_fraction})")
  manifest = {
      "format_version": FORMAT_VERSION,
      "tokenizer": dataclasses.asdict(tokenizer),
      "token_dtype": tfrecord.token_dtype(tokenizer.vocab_size),
      "source": {**options.arguments()["source"], "num_input_files": num_files,
                 **dataclasses.asdict(stats)},
      "splits": splits,
  }
  _write_json_atomically(options.output_dir / MANIFEST, manifest)
  return manifest


def prepare_dataset(options: PrepareOptions) -> pathlib.Path:
  """Writes the dataset unless it is already complete; returns its directory."""
  ensure_writable_dir(options.output_dir, "dataset directory")
  files = sources.resolve_files(options.source)
  _check_arguments(options, files)
  if (options.output_dir / MANIFEST).exists():
    return options.output_dir
  tokenizer_spec = _tokenizer_spec(options, files)
  tokenizer = identity(load_tokenizer(tokenizer_spec))
  _run_shards(options, files, tokenizer_spec)
  manifest = _write_manifest(options, tokenizer, len(files))
  logging.info("Prepared %s: %s documents, %s train tokens", options.output_dir,
               f"{manifest['source']['documents']:,}",
               f"{sum(s['num_tokens'] for s in manifest['splits']['train']):,}")
  return options.output_dir


def builtin_dataset(cache_dir: str, tokenizer: str, validation_fraction: float,
                    num_shards: int) -> pathlib.Path:
  """The Python-stdlib corpus, prepared under `cache_dir` on first use."""
  tokenizer_id = identity(load_tokenizer(tokenizer))
  name = "-".join([sources.stdlib_name(),
                   tokenizer_id.kind + (f"-{tokenizer_id.sha256[:12]}" if tokenizer_id.sha256 else ""),
                   f"val{validation_fraction:g}", f"shards{num_shards}", f"v{FORMAT_VERSION}"])
  directory = pathlib.Path(os.path.expanduser(cache_dir or DEFAULT_CACHE_DIR)) / name
  if not (directory / MANIFEST).exists():
    logging.info("Tokenizing the Python stdlib corpus into %s", directory)
  return prepare_dataset(PrepareOptions(
      source=sources.SourceSpec(kind="stdlib"), output_dir=directory, tokenizer=tokenizer,
      num_shards=num_shards, validation_fraction=validation_fraction))


def load_manifest(directory: pathlib.Path) -> dict:
  """Reads a dataset's manifest and checks that every shard it lists exists."""
  path = directory / MANIFEST
  if not path.exists():
    raise UserError(f"{directory} is not a prepared dataset (no {MANIFEST}); "
                    f"run python -m levanter_flax.prepare --output_dir={directory} ...")
  try:
    manifest = json.loads(path.read_text())
  except (OSError, ValueError) as e:
    raise UserError(f"cannot read dataset manifest {path}: {e}") from e
  if manifest.get("format_version") != FORMAT_VERSION:
    raise UserError(f"{path} has format_version {manifest.get('format_version')}; "
                    f"this trainer reads version {FORMAT_VERSION}; prepare the data again")
  for shards in manifest["splits"].values():
    for shard in shards:
      if not (directory / shard["file"]).exists():
        raise UserError(f"shard {directory / shard['file']} listed in {path} is missing")
  return manifest


def manifest_tokenizer(manifest: dict) -> TokenizerIdentity:
  return TokenizerIdentity(**manifest["tokenizer"])
