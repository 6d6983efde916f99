"""The prompts of a reinforcement-learning run: a JSON-lines file, one record a line, with
"prompt" (text, read as it is) or "messages" (a chat, rendered by the run's chat template with
its generation prompt), and any other fields ("answer", ...), which the rewards take
(objectives/rewards.py).

Every record is read and checked when the run starts, each failure one line naming the file and
line: not JSON, not an object, neither or both of prompt and messages, a chat without a
template, a field a reward takes missing. May import core and objectives.
"""
import dataclasses
import json
from typing import Any, Sequence

from etils import epath

from levanter_flax.core.errors import UserError
from levanter_flax.data import chat
from levanter_flax.objectives.rewards import Reward

_PROMPT_KEYS = ("prompt", "messages")


@dataclasses.dataclass(frozen=True)
class PromptRecord:
  text: str  # What the model continues: the prompt, or the chat rendered.
  fields: dict[str, Any]  # The record's other fields, for the rewards.
  where: str  # "FILE line N", for messages.
  messages: list | None = None  # A chat record's messages, whose reply ends at its end of turn.


def read(path: str, template: chat.ChatTemplate | None,
         rewards: Sequence[Reward] = ()) -> list[PromptRecord]:
  """Every record of the file at `path`, checked (see the module's docstring)."""
  file = epath.Path(path)
  if not file.is_file():
    raise UserError(f"the prompts file {path} does not exist")
  raw = file.read_bytes()
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    line = raw.count(b"\n", 0, e.start) + 1
    raise UserError(f"{path} line {line}: not UTF-8 text (byte {raw[e.start]:#04x})") from None
  records = []
  for number, line in enumerate(text.splitlines(), start=1):
    if line.strip():
      records.append(_record(line, f"{path} line {number}", template, rewards))
  if not records:
    raise UserError(f"the prompts file {path} holds no records")
  return records


def _record(line: str, where: str, template: chat.ChatTemplate | None,
            rewards: Sequence[Reward]) -> PromptRecord:
  try:
    record = json.loads(line)
  except json.JSONDecodeError as e:
    raise UserError(f"{where}: not JSON ({e.msg}, column {e.colno})") from None
  if not isinstance(record, dict):
    raise UserError(f"{where}: a record must be a JSON object, not {type(record).__name__}")
  given = [key for key in _PROMPT_KEYS if key in record]
  if len(given) != 1:
    raise UserError(f"{where}: a record needs \"prompt\" (text) or \"messages\" (a chat), "
                    f"one of them; it has {' and '.join(given) or 'neither'}")
  messages = None
  if "prompt" in record:
    text = record["prompt"]
    if not isinstance(text, str) or not text:
      raise UserError(f"{where}: \"prompt\" must be non-empty text")
  elif template is None:
    raise UserError(f"{where}: a chat record needs a chat template (the run's tokenizer has "
                    f"none)")
  else:
    messages = chat.checked_messages(record, where)
    text = template.render(messages, True, where)
  fields = {k: v for k, v in record.items() if k not in _PROMPT_KEYS}
  for reward in rewards:
    missing = [f for f in reward.fields if f not in fields]
    if missing:
      raise UserError(f"{where}: reward {reward.name} takes the field(s) {', '.join(missing)}, "
                      f"which this record does not have")
  return PromptRecord(text, fields, where, messages)
