"""Preference records -> one training row per pair, for DPO (levanter_flax/dpo.py).

A `preference` record is a JSON line in one of TRL's formats:
  {"prompt": "...", "chosen": "...", "rejected": "..."}: plain text, each reply joined to the
      prompt as a prompt_completion record is, the reply and the EOS after it weighted;
  {"messages": [...], "chosen": ..., "rejected": ...} (or "prompt": [...], TRL's conversational
      form): a conversation prefix, each reply a string (the assistant's content) or a list of
      one assistant message, rendered with the chat template as a chat record is, the reply's
      turn and its end-of-turn token weighted (chat.encode_reply).

Both replies must stay in one row of the batch, so a pair is one document of exactly seq_len
tokens with the EOS the loader appends (the dataset's seq_len, which the trainer's must equal;
every document that long, each of the loader's windows is one pair):

    EOS prompt chosen EOS prompt rejected EOS [EOS ...]

Each reply follows an EOS, as every document of the train stream does, so that under
document masking (which the trainer requires) the two read alike: attention within each, and
positions from 0 at its EOS. The loss weights are codes (dpo.CHOSEN on the chosen reply's
weighted targets, dpo.REJECTED on the rejected's, 0 elsewhere, the padding included). A pair
longer than seq_len is skipped and counted (its prompt is not cut: the replies would answer
another question).
"""
from typing import Optional

import numpy as np

from levanter_flax.data import chat
from levanter_flax.objectives.dpo import CHOSEN, REJECTED
from levanter_flax.core.errors import UserError

REPLIES = ("chosen", "rejected")


def _prompt(record: dict, where: str):
  """The record's prompt: a string, or a list of messages."""
  if "messages" in record:
    prompt, name = record["messages"], "messages"
  elif "prompt" in record:
    prompt, name = record["prompt"], "prompt"
  else:
    raise UserError(f"{where}: a preference record needs \"prompt\" (a string) or \"messages\" "
                    f"(a conversation), and \"chosen\" and \"rejected\"")
  if isinstance(prompt, str) and name == "prompt":
    return prompt
  if not isinstance(prompt, list) or not all(
      isinstance(m, dict) and isinstance(m.get("role"), str) for m in prompt):
    raise UserError(f"{where}: a preference record's {name!r} must be "
                    f"{'a string or ' if name == 'prompt' else ''}a list of messages (objects "
                    f"with a \"role\" and \"content\"); got {type(prompt).__name__}")
  return prompt


def _reply(record: dict, name: str, conversational: bool, where: str) -> dict:
  """The record's reply `name` as an assistant message."""
  if name not in record:
    raise UserError(f"{where}: a preference record needs \"chosen\" and \"rejected\"; it has no "
                    f"{name!r}")
  reply = record[name]
  if isinstance(reply, str):
    return {"role": "assistant", "content": reply}
  if (conversational and isinstance(reply, list) and len(reply) == 1
      and isinstance(reply[0], dict) and reply[0].get("role") == "assistant"
      and isinstance(reply[0].get("content"), str)):
    return reply[0]
  wanted = ("a string or a list of one assistant message ({\"role\": \"assistant\", "
            "\"content\": ...})" if conversational else "a string, as the prompt is")
  raise UserError(f"{where}: a preference record's {name!r} must be {wanted}; got "
                  f"{type(reply).__name__}")


class PairEncoder:
  """A preference record -> (its text, the row's tokens less the EOS the loader appends, the
  codes: the tokens' and that EOS's), or None for a pair too long for seq_len."""

  def __init__(self, tokenizer, template: Optional[chat.ChatTemplate], seq_len: int):
    self._tokenizer, self._template, self._seq_len = tokenizer, template, seq_len

  def __call__(self, record: dict, where: str) -> Optional[tuple[str, np.ndarray, np.ndarray]]:
    prompt = _prompt(record, where)
    conversational = not isinstance(prompt, str)
    if conversational and self._template is None:
      raise UserError(f"{where}: a conversational preference record is rendered with a chat "
                      f"template, and the tokenizer has none; pass --chat_template=FILE")
    eos = self._tokenizer.eos_id
    texts, tokens, codes = [], [np.array([eos])], [np.zeros(1, np.uint8)]
    for code, name in zip((CHOSEN, REJECTED), REPLIES):
      reply = _reply(record, name, conversational, where)
      text, reply_tokens, weights = chat.encode_reply(self._tokenizer, self._template, prompt,
                                                      reply, where)
      texts.append(text)
      tokens += [np.asarray(reply_tokens), np.array([eos])]
      codes.append(weights * np.uint8(code))  # Its tokens' and the EOS's after them.
    tokens = np.concatenate(tokens)[:-1]  # The loader appends the last EOS.
    if len(tokens) >= self._seq_len:
      return None
    padding = self._seq_len - 1 - len(tokens)
    return ("".join(texts), np.append(tokens, np.full(padding, eos)).astype(np.int64),
            np.concatenate([*codes, np.zeros(padding, np.uint8)]))
