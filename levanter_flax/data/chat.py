"""Chat and instruction records -> tokens and a loss weight per token.

A `chat` record is `{"messages": [{"role": ..., "content": ...}, ...]}` (the
OpenAI / Hugging Face format), rendered with the tokenizer's Jinja chat
template as transformers' `apply_chat_template(..., tokenize=False)` renders
it: the same sandboxed environment (trim_blocks, lstrip_blocks, loopcontrols,
`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII) and the
same variables (`messages`, `add_generation_prompt`, the special tokens of
tokenizer_config.json). jinja2 alone does it, so prepare needs no
transformers (and no torch).

Weight 1 goes to what the model is to learn to say: each assistant turn's
text after the template's generation prompt, up to and including its
end-of-turn (what the template writes after a reply, less whitespace: ChatML's
<|im_end|>, whatever tokenizer_config's eos_token is); weight 0 to the system
and user turns, the generation prompt ("<|im_start|>assistant\\n") and whatever
follows the end-of-turn (ChatML's newline), as transformers' assistant mask
weighs a template's {% generation %} block around reply and end. Each assistant
turn is found by rendering the conversation prefix by prefix: messages[:i]
with the generation prompt, then messages[:i+1]; the template must render
every prefix as the start of the whole (a template that rewrites earlier
turns is refused). The whole conversation is then tokenized once, as at
inference, and a token is weighted if its characters overlap an assistant
span, so the tokens are those the model will see.

A `prompt_completion` record is `{"prompt": ..., "completion": ...}`: the
plain text prompt + completion, the completion and the EOS after it weighted.
`encode_reply` weighs one reply to a prompt, either way (preference data).
"""
import dataclasses
import datetime
import functools
import hashlib
import json
from typing import Optional

import numpy as np

from levanter_flax.core import paths
from levanter_flax.core.errors import UserError

TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"  # transformers >= 4.43 saves the template beside.
# The special tokens transformers hands a template (its special_tokens_map).
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                   "mask_token")
# An assistant reply's text that no template writes of its own, to find what it writes after.
_PROBE = "levanter_flax end-of-turn probe"


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
  source: str  # Jinja text.
  origin: str  # The file it came from, for messages.
  special_tokens: tuple[tuple[str, str], ...]  # (name, text), as the template sees them.

  @property
  def sha256(self) -> str:
    return hashlib.sha256(self.source.encode("utf-8")).hexdigest()

  @functools.cached_property
  def compiled(self):
    return _compile(self.source, self.origin)

  def render(self, messages: list, add_generation_prompt: bool, where: str) -> str:
    import jinja2  # pylint: disable=g-import-not-at-top  # Only chat sources need it.
    try:
      return self.compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                  tools=None, documents=None, **dict(self.special_tokens))
    except jinja2.TemplateError as e:  # raise_exception's, or the template's own mistake.
      raise UserError(f"{where}: the chat template ({self.origin}) refuses this conversation: "
                      f"{e}") from None
    except Exception as e:  # pylint: disable=broad-except  # A template may do anything.
      raise UserError(f"{where}: the chat template ({self.origin}) failed on this conversation: "
                      f"{type(e).__name__}: {e}") from None

  def end_of_turn(self, messages: list, where: str) -> str:
    """What the template writes after the reply of `messages`' last (assistant) message, less
    whitespace: the token a reply ends with. From the template, not tokenizer_config's eos_token,
    which a base tokenizer sets to another token (Qwen2's <|endoftext|>, not <|im_end|>)."""
    probe = [*messages[:-1], dict(messages[-1], content=_PROBE)]
    _, found, after = self.render(probe, False, where).rpartition(_PROBE)
    return after.strip() if found else ""


def _compile(source: str, origin: str):
  """The template in transformers' environment (utils/chat_template_utils.py)."""
  import jinja2  # pylint: disable=g-import-not-at-top  # Only chat sources need it.
  from jinja2 import ext, sandbox  # pylint: disable=g-import-not-at-top

  class Generation(ext.Extension):
    """transformers' {% generation %} ... {% endgeneration %}: it only marks assistant text for
    its assistant mask, so here it renders its body."""
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
      return caller()

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  environment = sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[Generation, ext.loopcontrols])
  environment.filters["tojson"] = tojson
  environment.globals["raise_exception"] = raise_exception
  environment.globals["strftime_now"] = lambda f: datetime.datetime.now().strftime(f)
  try:
    return environment.from_string(source)
  except jinja2.TemplateSyntaxError as e:
    raise UserError(f"chat template {origin} is not valid Jinja: line {e.lineno}: {e.message}"
                    ) from None


def _token_text(value) -> Optional[str]:
  """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) else None


def _read_json(path) -> dict:
  try:
    value = json.loads(path.read_text())
  except (OSError, ValueError) as e:
    raise UserError(f"cannot read {path}: {e}") from None
  if not isinstance(value, dict):
    raise UserError(f"{path} is not a JSON object")
  return value


def load_template(tokenizer_spec: str, template_file: str) -> ChatTemplate:
  """The chat template: `template_file` (--chat_template) if given, else the tokenizer's, from
  chat_template.jinja or tokenizer_config.json beside its tokenizer.json, as transformers
  finds it."""
  config, config_path = {}, None
  if tokenizer_spec != "byte":
    tokenizer_path = paths.resolve(tokenizer_spec, "--tokenizer")
    config_path = tokenizer_path.parent / TOKENIZER_CONFIG
    config = _read_json(config_path) if config_path.exists() else {}
  if template_file:
    origin = paths.resolve(template_file, "--chat_template")
    if not origin.is_file():
      raise UserError(f"--chat_template {template_file}: no such file")
    source = origin.read_text()
  elif tokenizer_spec != "byte" and (tokenizer_path.parent / TEMPLATE_FILE).exists():
    origin = tokenizer_path.parent / TEMPLATE_FILE
    source = origin.read_text()
  else:
    origin, source = config_path, config.get("chat_template")
    if isinstance(source, list):  # Named templates: transformers' default is "default".
      source = next((t.get("template") for t in source
                     if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(source, str) or not source.strip():
      raise UserError(f"tokenizer {tokenizer_spec} has no chat template (no {TEMPLATE_FILE}, and "
                      f"no chat_template in a {TOKENIZER_CONFIG} beside it); pass "
                      f"--chat_template=FILE (a Jinja template)")
  special = tuple((name, text) for name in _SPECIAL_TOKENS
                  if (text := _token_text(config.get(name))) is not None)
  template = ChatTemplate(source, str(origin), special)
  template.compiled  # pylint: disable=pointless-statement  # A syntax error, now.
  return template


def recorded_template(tokenizer_spec: str, record: dict, dataset: str) -> ChatTemplate:
  """The template a chat dataset was prepared with, from its manifest's `chat_template` record
  ({file, sha256}), if that file still holds it: a template edited since would render prompts
  the model never saw."""
  file, sha256 = record.get("file"), record.get("sha256")
  if not isinstance(file, str) or not isinstance(sha256, str):
    raise UserError(f"{dataset}'s manifest has a malformed chat_template record: {record}")
  path = paths.resolve(file, "the manifest's chat_template")
  if not path.exists():
    raise UserError(f"chat template {file}, which {dataset} was prepared with, is gone; put it "
                    f"back or pass --chat_template=FILE")
  # The tokenizer's own template is found as prepare found it; any other file is the template.
  own = (tokenizer_spec != "byte" and path.name in (TOKENIZER_CONFIG, TEMPLATE_FILE)
         and path.parent == paths.resolve(tokenizer_spec, "data.tokenizer").parent)
  template = load_template(tokenizer_spec, "" if own else file)
  if template.sha256 != sha256:
    raise UserError(f"chat template {file} changed since {dataset} was prepared with it "
                    f"(sha256 {template.sha256[:12]}, not {sha256[:12]}); put it back or pass "
                    f"--chat_template=FILE")
  return template


def checked_messages(record: dict, where: str) -> list:
  messages = record.get("messages")
  if not isinstance(messages, list) or not all(
      isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
    raise UserError(f"{where}: a chat record needs \"messages\": a list of objects with a "
                    f"\"role\" and \"content\"")
  return messages


def assistant_spans(template: ChatTemplate, messages: list, where: str) -> tuple[str, list]:
  """(the rendered conversation, [(start, end)] character spans of its weighted text)."""
  whole = template.render(messages, False, where)
  spans = []
  for i, message in enumerate(messages):
    if message["role"] != "assistant":
      continue
    prompt = template.render(messages[:i], True, where)
    turn = template.render(messages[:i + 1], False, where)
    if not (turn.startswith(prompt) and whole.startswith(turn)):
      raise UserError(f"{where}: the chat template ({template.origin}) renders the conversation "
                      f"up to message {i} otherwise than as the start of the whole (does it "
                      f"rewrite earlier turns?); its assistant tokens cannot be told apart")
    said = turn[len(prompt):]
    end_of_turn = template.end_of_turn(messages[:i + 1], where)
    # The last occurrence: a reply may quote the end-of-turn text, and it is all weighted.
    end = said.rfind(end_of_turn) if end_of_turn else -1
    length = end + len(end_of_turn) if end >= 0 else len(said)
    spans.append((len(prompt), len(prompt) + length))
  return whole, spans


def _weights(offsets: np.ndarray, spans: list) -> np.ndarray:
  """1 for each token (character offsets [start, end)) that overlaps a span."""
  weights = np.zeros(len(offsets), np.uint8)
  for start, end in spans:
    weights |= (offsets[:, 1] > start) & (offsets[:, 0] < end)
  return weights


def encode_reply(tokenizer, template: Optional[ChatTemplate], prompt, reply: dict,
                 where: str) -> tuple[str, np.ndarray, np.ndarray]:
  """(text, tokens, loss weights: the tokens' and the EOS's) of one reply to a prompt, only the
  reply weighted: a string prompt and reply joined as plain text (the EOS after it weighted, as
  a completion's), or a conversation (a list of messages) and the assistant message `reply`
  rendered by `template`, its turn weighted as a chat's (preference data: data/preference.py)."""
  if isinstance(prompt, str):
    text = prompt + reply["content"]
    spans, eos_weight = [(len(prompt), len(text))], 1
  else:
    text, spans = assistant_spans(template, [*prompt, reply], where)
    spans, eos_weight = spans[-1:], 0
  tokens, offsets = tokenizer.encode_with_offsets(text)
  return text, tokens, np.append(_weights(offsets, spans), np.uint8(eos_weight))


class Encoder:
  """A chat or prompt_completion record -> its text, tokens, and loss weights (the tokens' and
  the EOS's the loader appends), or None for a conversation with no assistant turn (skipped)."""

  def __init__(self, kind: str, tokenizer, template: Optional[ChatTemplate]):
    self._kind, self._tokenizer, self._template = kind, tokenizer, template

  def __call__(self, record: dict, where: str) -> Optional[tuple[str, np.ndarray, np.ndarray]]:
    if self._kind == "chat":
      messages = checked_messages(record, where)
      if not any(m["role"] == "assistant" for m in messages):
        return None
      text, spans = assistant_spans(self._template, messages, where)
      eos_weight = 0  # The conversation's last turn ended with its own end-of-turn token.
    else:
      for field in ("prompt", "completion"):
        if not isinstance(record.get(field), str):
          raise UserError(f"{where}: a prompt_completion record needs a string {field!r}")
      text = record["prompt"] + record["completion"]
      spans, eos_weight = [(len(record["prompt"]), len(text))], 1
    tokens, offsets = self._tokenizer.encode_with_offsets(text)
    return text, tokens, np.append(_weights(offsets, spans), np.uint8(eos_weight))
