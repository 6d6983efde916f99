"""Tokenizes a corpus once into sharded TFRecord files plus a manifest.json.

The manifest is written last, so a dataset directory with a manifest is
complete; one without is rebuilt from scratch.
"""
import json
import os
import pathlib
import zlib
from typing import Iterable

from absl import logging

from levanter_flax.data import DataConfig, corpus, tfrecord
from levanter_flax.data.tokenizers import get_tokenizer
from levanter_flax.errors import UserError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DEFAULT_CACHE_DIR = "~/.cache/levanter_flax"


def is_validation(name: str, validation_fraction: float) -> bool:
  """A stable, order-independent split: a document's name alone decides it."""
  return zlib.crc32(name.encode("utf-8")) / 2**32 < validation_fraction


def _documents(corpus_name: str) -> Iterable[tuple[str, str]]:
  if corpus_name == "stdlib":
    return corpus.stdlib_documents()
  raise UserError(f"config.data.corpus {corpus_name!r} is unknown; the built-in corpus is 'stdlib'")


def dataset_dir(cfg: DataConfig) -> pathlib.Path:
  cache_dir = pathlib.Path(os.path.expanduser(cfg.cache_dir or DEFAULT_CACHE_DIR))
  corpus_id = corpus.stdlib_name() if cfg.corpus == "stdlib" else cfg.corpus
  return cache_dir / f"{corpus_id}-{cfg.tokenizer}-val{cfg.validation_fraction:g}-shards{cfg.num_train_shards}"


def load_manifest(directory: pathlib.Path) -> dict:
  path = directory / MANIFEST
  try:
    manifest = json.loads(path.read_text())
  except (OSError, ValueError) as e:
    raise UserError(f"cannot read dataset manifest {path}: {e}") from e
  if manifest.get("format_version") != FORMAT_VERSION:
    raise UserError(f"{path} has format_version {manifest.get('format_version')}; "
                    f"this trainer reads version {FORMAT_VERSION}")
  return manifest


def prepare(cfg: DataConfig) -> pathlib.Path:
  """Returns the directory of the prepared dataset, tokenizing it first if needed."""
  directory = dataset_dir(cfg)
  if (directory / MANIFEST).exists():
    return directory
  try:
    directory.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise UserError(f"cannot create dataset directory {directory} (config.data.cache_dir): "
                    f"{e.strerror or e}") from e
  if not os.access(directory, os.W_OK):
    raise UserError(f"dataset directory {directory} (config.data.cache_dir) is not writable")
  logging.info("Tokenizing corpus %r into %s", cfg.corpus, directory)
  tokenizer = get_tokenizer(cfg.tokenizer)
  dtype = tfrecord.token_dtype(tokenizer.vocab_size)
  train, validation, empty = [], [], 0
  for name, text in _documents(cfg.corpus):
    tokens = tokenizer.encode(text)
    if not len(tokens):
      empty += 1  # E.g. empty __init__.py files: nothing to learn, but counted.
      continue
    (validation if is_validation(name, cfg.validation_fraction) else train).append(tokens)
  if not train or not validation:
    raise UserError(f"corpus {cfg.corpus!r} gave {len(train)} training and {len(validation)} "
                    f"validation documents; adjust config.data.validation_fraction")
  splits = {
      "train": [train[i::cfg.num_train_shards] for i in range(cfg.num_train_shards)],
      "validation": [validation],
  }
  manifest = {
      "format_version": FORMAT_VERSION,
      "tokenizer": {"name": tokenizer.name, "vocab_size": tokenizer.vocab_size,
                    "eos_id": tokenizer.eos_id},
      "token_dtype": dtype,
      "sources": [{"corpus": cfg.corpus, "root": str(corpus.stdlib_root()),
                   "empty_documents_skipped": empty}],
      "splits": {},
  }
  for split, shards in splits.items():
    manifest["splits"][split] = []
    for index, documents in enumerate(shards):
      filename = f"{split}-{index:05d}-of-{len(shards):05d}.tfrecord"
      num_documents, num_tokens = tfrecord.write_shard(str(directory / filename), documents, dtype)
      manifest["splits"][split].append(
          {"file": filename, "num_documents": num_documents, "num_tokens": num_tokens})
  tmp = directory / f"{MANIFEST}.tmp-{os.getpid()}"
  tmp.write_text(json.dumps(manifest, indent=2))
  os.replace(tmp, directory / MANIFEST)
  return directory
