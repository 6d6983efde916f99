"""Tokenizers: byte-level (no files), Hugging Face `tokenizers` JSON, SentencePiece.

A tokenizer is named by a spec: "byte", or the path of a tokenizer.json or a
SentencePiece .model file. Its identity (kind, file hash, vocab size, EOS id)
goes into every dataset manifest, so a run can refuse data made with another.

Two ends are told apart: `eos_id`, the one token that ends each training document (what
`prepare` writes and the manifest records), and `stop_ids`, every token a generation ends at,
read from the checkpoint beside a tokenizer.json as transformers and vLLM read it:
generation_config.json's eos_token_id (an int or a list), else config.json's, else
tokenizer_config.json's eos_token. A bare tokenizer.json ends both at the first of
EOS_CANDIDATES it has. A model trained here also ends its documents at eos_id, so its
generations end there too (`ending_documents`).
"""
import copy
import dataclasses
import functools
import hashlib
import json
import types
from typing import Iterable, Mapping

import numpy as np
from etils import epath

from levanter_flax.core import paths
from levanter_flax.core.errors import UserError

# End-of-document tokens tried, in order, before the checkpoint's own EOS.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
# Where transformers' AutoTokenizer reads a tokenizer.json's special tokens: beside it.
TOKENIZER_CONFIG = "tokenizer_config.json"
# The files beside a tokenizer.json that name the ids a generation ends at, in the order
# transformers' GenerationConfig reads them.
STOP_ID_FILES = ("generation_config.json", "config.json")
# The special tokens read from it: those lm-eval's HF backend scores and stops with.
SPECIAL_TOKENS = ("bos_token", "eos_token")
# Tokenizers with no tokenizer_config.json name none of them for transformers.
_NONE_NAMED: Mapping[str, tuple[int, str]] = types.MappingProxyType({})


@dataclasses.dataclass(frozen=True)
class TokenizerIdentity:
  kind: str  # byte | huggingface | sentencepiece
  sha256: str  # Of the tokenizer file; "" for byte.
  vocab_size: int
  eos_id: int

  def matches(self, other: "TokenizerIdentity") -> bool:
    return (self.kind, self.sha256, self.vocab_size) == (other.kind, other.sha256, other.vocab_size)

  def describe(self) -> str:
    return self.kind if self.kind == "byte" else f"{self.kind} sha256:{self.sha256[:12]}"


class ByteTokenizer:
  """UTF-8 bytes as tokens 0..255, plus an end-of-document token."""
  vocab_size = 257
  eos_id = 256
  stop_ids = (256,)
  eos_text = ""  # No text stands for it.
  kind, sha256 = "byte", ""
  special_tokens = _NONE_NAMED

  def encode(self, text: str, add_special_tokens: bool = False) -> np.ndarray:
    del add_special_tokens  # It has none to add.
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

  def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, int[tokens, 2]: each one's character span [start, end) in `text`)."""
    chars = np.repeat(np.arange(len(text)), [len(c.encode("utf-8")) for c in text])
    return self.encode(text), np.stack([chars, chars + 1], axis=1).reshape(-1, 2)

  def decode(self, ids) -> str:
    return bytes(int(i) for i in ids if i < 256).decode("utf-8", errors="replace")


class HuggingFaceTokenizer:
  """A `tokenizers` JSON file, e.g. GPT-2's or one made by `--train_tokenizer`, and the JSON
  files of its checkpoint beside it (`beside`: file name -> contents, of those that exist)."""
  kind = "huggingface"

  def __init__(self, path: epath.Path, contents: bytes, beside: Mapping[str, bytes]):
    self._directory = path.parent
    import tokenizers  # pylint: disable=g-import-not-at-top
    try:
      self._tokenizer = tokenizers.Tokenizer.from_str(contents.decode("utf-8"))
    except Exception as e:  # pylint: disable=broad-except  # The Rust side raises bare Exceptions.
      reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
      raise UserError(f"cannot load tokenizer {path}: not a Hugging Face tokenizer.json "
                      f"({reason})") from None
    self.sha256 = hashlib.sha256(contents).hexdigest()
    self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
    self._beside = dict(beside)
    found = [i for i in (self._tokenizer.token_to_id(t) for t in EOS_CANDIDATES) if i is not None]
    if not found:  # DeepSeek-V3's <｜end▁of▁sentence｜>: the checkpoint names it.
      named = self.special_tokens.get("eos_token")
      found = [*([named[0]] if named else []), *self._checkpoint_stop_ids()]
    if not found:
      raise UserError(f"tokenizer {path} has none of the end-of-document tokens "
                      f"{EOS_CANDIDATES}, and no {TOKENIZER_CONFIG}, "
                      f"{' or '.join(STOP_ID_FILES)} beside it names its EOS")
    self.eos_id = found[0]
    self.eos_text = self._tokenizer.id_to_token(self.eos_id)

  @functools.cached_property
  def special_tokens(self) -> Mapping[str, tuple[int, str]]:
    """name -> (id, text) of each of SPECIAL_TOKENS that the tokenizer_config.json beside the
    file names: the tokens transformers' AutoTokenizer, and so lm-eval's HF backend, knows by
    those names. Read when asked, as stop_ids: preparing and training read neither."""
    config = self._config(TOKENIZER_CONFIG)
    named = {}
    for name in SPECIAL_TOKENS:
      value = config.get(name)
      text = value.get("content") if isinstance(value, dict) else value  # Or an AddedToken.
      if not isinstance(text, str):
        continue
      token = self._tokenizer.token_to_id(text)
      if token is None:
        raise UserError(f"{self._where(TOKENIZER_CONFIG)}: its {name} {text!r} is no token of "
                        f"the tokenizer")
      named[name] = (token, text)
    return types.MappingProxyType(named)

  @functools.cached_property
  def stop_ids(self) -> tuple[int, ...]:
    """The ids a generation ends at (see the module's docstring)."""
    return self._checkpoint_stop_ids() or (self.eos_id,)

  def _config(self, name: str) -> dict:
    """The JSON object of the file `name` beside the tokenizer; {} if there is none."""
    return _json_object(self._directory / name, self._beside[name]) if name in self._beside else {}

  def _checkpoint_stop_ids(self) -> tuple[int, ...]:
    """The ids the checkpoint's generation ends at (see the module's docstring); () if no file
    beside the tokenizer names one."""
    for name in STOP_ID_FILES:
      value = self._config(name).get("eos_token_id")
      if value is None:
        continue
      ids = value if isinstance(value, list) else [value]
      if not ids or not all(isinstance(i, int) and not isinstance(i, bool)
                            and 0 <= i < self.vocab_size for i in ids):
        raise UserError(f"{self._where(name)}: eos_token_id {value!r} must be a token id or a "
                        f"list of them, each in [0, {self.vocab_size})")
      return tuple(dict.fromkeys(ids))
    if "eos_token" in self.special_tokens:
      return (self.special_tokens["eos_token"][0],)
    return ()

  def _where(self, name: str) -> str:
    return str(self._directory / name)

  def encode(self, text: str, add_special_tokens: bool = False) -> np.ndarray:
    """`text`'s tokens; `add_special_tokens`: with those the file's post-processor puts around
    a text (Llama 3's, Mistral's, Gemma's BOS), as transformers encodes by default. Documents
    have none: an EOS parts them."""
    return np.asarray(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids,
                      dtype=np.int32)

  def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, int[tokens, 2]: each one's character span [start, end) in `text`)."""
    encoding = self._tokenizer.encode(text, add_special_tokens=False)
    return (np.asarray(encoding.ids, dtype=np.int32),
            np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2))

  def decode(self, ids) -> str:
    return self._tokenizer.decode([int(i) for i in ids])


class SentencePieceTokenizer:
  """A SentencePiece .model file; its own EOS id ends each document."""
  kind = "sentencepiece"

  def __init__(self, path: epath.Path, contents: bytes):
    import sentencepiece  # pylint: disable=g-import-not-at-top
    try:
      self._processor = sentencepiece.SentencePieceProcessor(model_proto=contents)
    except (OSError, RuntimeError) as e:
      raise UserError(f"cannot load SentencePiece model {path}: {e}") from e
    self.sha256 = hashlib.sha256(contents).hexdigest()
    self.vocab_size = self._processor.get_piece_size()
    self.eos_id = self._processor.eos_id()
    if self.eos_id < 0:
      raise UserError(f"SentencePiece model {path} has no EOS piece (it was trained with eos_id=-1)")
    self.stop_ids = (self.eos_id,)

  special_tokens = _NONE_NAMED

  def encode(self, text: str, add_special_tokens: bool = False) -> np.ndarray:
    del add_special_tokens  # transformers reads no .model file alone: nothing to match.
    return np.asarray(self._processor.encode(text), dtype=np.int32)

  def decode(self, ids) -> str:
    return self._processor.decode([int(i) for i in ids])


def load_tokenizer(spec: str):
  """"byte", a tokenizer.json path, or a SentencePiece .model path -> a tokenizer.

  One tokenizer per path and contents: a file rewritten in place (a notebook's) is read anew.
  """
  if spec == "byte":
    return ByteTokenizer()
  path = paths.resolve(spec, "tokenizer")
  if not path.is_file():
    raise UserError(f"tokenizer {spec!r} is neither 'byte' nor an existing tokenizer.json or "
                    f"SentencePiece .model file")
  if path.suffix not in (".json", ".model"):
    raise UserError(f"tokenizer file {path} must end in .json (Hugging Face) or .model "
                    f"(SentencePiece)")
  beside = ()
  if path.suffix == ".json":
    beside = tuple((name, (path.parent / name).read_bytes())
                   for name in (TOKENIZER_CONFIG, *STOP_ID_FILES)
                   if (path.parent / name).is_file())
  return _tokenizer_of(str(path), path.read_bytes(), beside)


@functools.lru_cache(maxsize=8)
def _tokenizer_of(path: str, contents: bytes, beside: tuple[tuple[str, bytes], ...]):
  if path.endswith(".json"):
    return HuggingFaceTokenizer(epath.Path(path), contents, dict(beside))
  return SentencePieceTokenizer(epath.Path(path), contents)


def _json_object(path: epath.Path, contents: bytes) -> dict:
  try:
    value = json.loads(contents)
  except ValueError as e:
    raise UserError(f"cannot read {path}: {e}") from None
  if not isinstance(value, dict):
    raise UserError(f"{path} is not a JSON object")
  return value


def ending_documents(tokenizer):
  """`tokenizer` for a model trained on documents it tokenized: its generations end at its
  checkpoint's stop ids and at the EOS that ended each of those documents."""
  if tokenizer.eos_id in tokenizer.stop_ids:
    return tokenizer
  trained = copy.copy(tokenizer)  # The cached one serves checkpoints as they are.
  trained.stop_ids = (*tokenizer.stop_ids, tokenizer.eos_id)
  return trained


def identity(tokenizer) -> TokenizerIdentity:
  return TokenizerIdentity(tokenizer.kind, tokenizer.sha256, tokenizer.vocab_size, tokenizer.eos_id)


def train_bpe(texts: Iterable[str], vocab_size: int, path: epath.Path) -> None:
  """Trains a byte-level BPE (GPT-2's scheme) on `texts` and saves it as tokenizer.json."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  from tokenizers import decoders, models, pre_tokenizers, trainers  # pylint: disable=g-import-not-at-top
  tokenizer = tokenizers.Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_CANDIDATES[0]],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tokenizer.train_from_iterator(texts, trainer=trainer)
  paths.write_atomically(path, tokenizer.to_str())
