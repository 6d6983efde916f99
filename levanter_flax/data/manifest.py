"""A prepared dataset as its readers see it: manifest.json, read and checked.

commands/prepare.py writes the manifest; the loader, the eval set, sampling and the
benchmarks read it through this module, which imports neither the writer nor
TensorFlow.
"""
import dataclasses
import functools
import hashlib
import json
import pathlib

from etils import epath

from levanter_flax.data.tokenizers import TokenizerIdentity
from levanter_flax.core.errors import UserError

FORMAT_VERSION = 2
# A dataset with loss weights (chat and instruction data; tfrecord.py): a version of its own, so
# that a trainer from before weights refuses it rather than train on every token.
WEIGHTED_FORMAT_VERSION = 3
# Preference data (data/preference.py): weighted, each document one pair of `seq_len` tokens
# whose weights are DPO's codes; a version of its own, so that no trainer takes it for chat data.
PREFERENCE_FORMAT_VERSION = 4
VERSIONS = (FORMAT_VERSION, WEIGHTED_FORMAT_VERSION, PREFERENCE_FORMAT_VERSION)
MANIFEST = "manifest.json"
SPLITS = ("train", "validation")

# What the trainer reads from a manifest, and of which type.
_TOKENIZER_FIELDS = {"kind": str, "sha256": str, "vocab_size": int, "eos_id": int}
_SHARD_FIELDS = {"file": str, "num_documents": int, "num_tokens": int, "num_text_bytes": int}
_WEIGHTED_SHARD_FIELDS = {"loss_weights_crc32c": int, "num_loss_tokens": int}


def has_loss_weights(manifest: dict) -> bool:
  """Whether the dataset's documents carry loss weights (else every token's is 1)."""
  return manifest.get("format_version") in (WEIGHTED_FORMAT_VERSION, PREFERENCE_FORMAT_VERSION)


def preference_seq_len(manifest: dict) -> int:
  """A preference dataset's row length (each document one pair); 0 for any other dataset."""
  if manifest.get("format_version") != PREFERENCE_FORMAT_VERSION:
    return 0
  return manifest["seq_len"]


def _lacks(value, where: str, fields: dict[str, type]) -> str:
  """What `value`, called `where`, lacks of `fields` (name -> type), or ""."""
  if not isinstance(value, dict):
    return f"no {where} object"
  missing = [k for k, kind in fields.items() if not isinstance(value.get(k), kind)]
  return f"{where} lacks {', '.join(missing)}" if missing else ""


def _manifest_problem(manifest: dict) -> str:
  """What makes a manifest (of the right version) unusable, or ""."""
  if problem := _lacks(manifest.get("tokenizer"), "'tokenizer'", _TOKENIZER_FIELDS):
    return problem
  if manifest["format_version"] == PREFERENCE_FORMAT_VERSION and not (
      isinstance(manifest.get("seq_len"), int) and manifest["seq_len"] > 0):
    return "a preference dataset's 'seq_len' is not a positive integer"
  if manifest.get("token_dtype") not in ("uint16", "int32"):
    return f"'token_dtype' is {manifest.get('token_dtype')!r}, not uint16 or int32"
  splits = manifest.get("splits")
  for split in SPLITS:
    if not isinstance(splits, dict) or not isinstance(splits.get(split), list):
      return f"'splits' has no {split} list"
    for i, shard in enumerate(splits[split]):
      if problem := _lacks(shard, f"splits.{split}[{i}]", _SHARD_FIELDS):
        return problem
      if has_loss_weights(manifest) and (
          problem := _lacks(shard, f"splits.{split}[{i}]", _WEIGHTED_SHARD_FIELDS)):
        return problem
      if not isinstance(shard.get("tokens_crc32c", 0), int):  # Absent before checksums.
        return f"splits.{split}[{i}] has a tokens_crc32c that is not an integer"
  return ""


def _is_inside(file: str) -> bool:
  """Whether a shard's file names one in the dataset directory: relative, without '..'.

  Lexical only: a shard the user symlinked onto another disk is still read.
  """
  parts = pathlib.PurePath(file).parts
  return bool(parts) and not pathlib.PurePath(file).is_absolute() and ".." not in parts


def load_manifest(directory: epath.Path) -> dict:
  """Reads a dataset's manifest and checks its fields and that every shard it lists exists."""
  path = directory / MANIFEST
  if not path.exists():
    raise UserError(f"{directory} is not a prepared dataset (no {MANIFEST}); "
                    f"run levanter-flax prepare --output_dir={directory} ...")
  try:
    manifest = json.loads(path.read_text())
  except (OSError, ValueError) as e:
    raise UserError(f"cannot read dataset manifest {path}: {e}") from e
  if not isinstance(manifest, dict):
    raise UserError(f"dataset manifest {path} is not a JSON object; prepare the data again")
  if manifest.get("format_version") not in VERSIONS:
    raise UserError(f"{path} has format_version {manifest.get('format_version')}; "
                    f"this trainer reads versions {FORMAT_VERSION}, {WEIGHTED_FORMAT_VERSION} "
                    f"(with loss weights) and {PREFERENCE_FORMAT_VERSION} (preference pairs); "
                    f"prepare the data again")
  if problem := _manifest_problem(manifest):
    raise UserError(f"dataset manifest {path} is malformed: {problem}; prepare the data again")
  for split in SPLITS:
    for shard in manifest["splits"][split]:
      if not _is_inside(shard["file"]):
        raise UserError(f"dataset manifest {path} lists shard file {shard['file']!r}, which is "
                        f"outside its directory")
      if not (directory / shard["file"]).exists():
        raise UserError(f"shard {directory / shard['file']} listed in {path} is missing")
  return manifest


def manifest_tokenizer(manifest: dict) -> TokenizerIdentity:
  return TokenizerIdentity(**{k: manifest["tokenizer"][k] for k in _TOKENIZER_FIELDS})


@dataclasses.dataclass(frozen=True)
class PreparedDataset:
  """One prepared dataset of the run (a directory and its manifest), with its name and
  mixture weight."""
  name: str
  directory: epath.Path
  manifest: dict
  weight: float

  def files(self, split: str) -> list[str]:
    return [str(self.directory / shard["file"]) for shard in self.manifest["splits"][split]]

  @functools.cached_property
  def manifest_sha256(self) -> str:
    """Which data this is: prepared again or replaced under the same path, it differs."""
    return hashlib.sha256(json.dumps(self.manifest, sort_keys=True).encode()).hexdigest()

  @property
  def has_loss_weights(self) -> bool:
    return has_loss_weights(self.manifest)

  @property
  def preference_seq_len(self) -> int:
    return preference_seq_len(self.manifest)

  @property
  def has_validation(self) -> bool:
    return any(s["num_documents"] for s in self.manifest["splits"]["validation"])

  @property
  def validation_tokens_per_byte(self) -> float:
    """Tokens the eval stream predicts (EOS included) per byte of validation text."""
    shards = self.manifest["splits"]["validation"]
    tokens = sum(s["num_tokens"] + s["num_documents"] for s in shards)
    return tokens / max(sum(s["num_text_bytes"] for s in shards), 1)
