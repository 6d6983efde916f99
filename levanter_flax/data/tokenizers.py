"""Tokenizers: text <-> token ids. The byte-level one needs no download."""
import numpy as np

from levanter_flax.errors import UserError


class ByteTokenizer:
  """UTF-8 bytes as tokens 0..255, plus an end-of-document token."""
  name = "byte"
  vocab_size = 257
  eos_id = 256

  def encode(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

  def decode(self, ids) -> str:
    return bytes(int(i) for i in ids if i < 256).decode("utf-8", errors="replace")


TOKENIZERS = {"byte": ByteTokenizer}


def get_tokenizer(name: str):
  if name not in TOKENIZERS:
    raise UserError(f"config.data.tokenizer {name!r} is unknown; choose one of {sorted(TOKENIZERS)}")
  return TOKENIZERS[name]()
