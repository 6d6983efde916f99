r"""Text from the latest checkpoint of a run, decoded on a KV cache.

    python -m levanter_flax.sample --workdir=runs/gpt2_nano --prompt="def " --prompt="import " \
        --max_new_tokens=100 --temperature=0.8 --top_k=40

Prompts of different lengths are left-padded into one batch. temperature 0
is greedy decoding; top_k and top_p restrict sampling to the likeliest tokens.
Each prompt follows an EOS, as every document the model trained on did
(--no_bos: not), so an empty prompt starts a new document. The tokenizer is
the run's (config.json's data.tokenizer), and must still be the file its
datasets were tokenized with.

    python -m levanter_flax.sample --workdir=runs/chat --chat --system="Be brief." \
        --prompt="What is a KV cache?" --max_new_tokens=200

--chat renders each prompt as a user message with the run's chat template
(data/chat.py, as transformers' apply_chat_template(add_generation_prompt=True)
does) and prints the reply alone, which ends at the template's end-of-turn token
(what it writes after a reply, e.g. <|im_end|>) or the EOS, both left out.
"""
import dataclasses
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from levanter_flax.parallel import backend
from levanter_flax.core import cli, paths
from levanter_flax.generate import decoding
from levanter_flax.generate import trained
from levanter_flax.generate.trained import run_params
from levanter_flax.generate.decoding import SamplingConfig, choose  # pylint: disable=unused-import  # Its API.
from levanter_flax.core.errors import UserError, exit_with_error


def check_ranges(cfg: SamplingConfig) -> None:
  """absl's flag bounds let NaN through: every comparison with it is False."""
  if not 0 <= cfg.top_p <= 1:
    raise UserError(f"--top_p must be in [0, 1]; got {cfg.top_p}")
  if not 0 <= cfg.temperature < float("inf"):
    raise UserError(f"--temperature must be >= 0 and finite; got {cfg.temperature}")


def check_top_k(cfg: SamplingConfig, vocab_size: int) -> None:
  """lax.top_k cannot take more tokens than there are; say so before anything is compiled."""
  if cfg.top_k > vocab_size:
    raise UserError(f"--top_k {cfg.top_k} exceeds the model's vocabulary of {vocab_size} tokens; "
                    f"use at most {vocab_size}, or 0 for no limit")


def left_pad(prompts: Sequence[Sequence[int]], seq_len: int, cfg: SamplingConfig):
  """(tokens, token_mask, positions), each [batch, longest prompt]."""
  room = seq_len - cfg.max_new_tokens
  if room < 1:
    raise UserError(f"max_new_tokens {cfg.max_new_tokens} leaves no room for a prompt in the "
                    f"model's seq_len {seq_len}")
  too_long = [len(p) for p in prompts if len(p) > room]
  if too_long and cfg.long_prompt != "truncate":
    raise UserError(f"a prompt of {max(too_long)} tokens plus max_new_tokens {cfg.max_new_tokens} "
                    f"exceeds the model's seq_len {seq_len}; shorten it, lower max_new_tokens, "
                    f"or pass --long_prompt=truncate to keep its last {room} tokens")
  prompts = [list(p)[-room:] for p in prompts]
  if not all(prompts):
    raise UserError("a prompt is empty: there is nothing to continue")
  longest = max(map(len, prompts))
  tokens = np.zeros((len(prompts), longest), np.int32)
  mask = np.zeros((len(prompts), longest), bool)
  for row, prompt in enumerate(prompts):
    tokens[row, longest - len(prompt):] = prompt
    mask[row, longest - len(prompt):] = True
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
  return jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(positions)


def generate(model_cfg: Any, params: Any, prompts: Sequence[Sequence[int]],
             cfg: SamplingConfig) -> list[list[int]]:
  """Each prompt's continuation: max_new_tokens token ids, or fewer, up to (not including) its
  first token of cfg.stop_ids. One compiled program (decoding.py): decoding ends on the device
  once every row has stopped."""
  check_top_k(cfg, model_cfg.vocab_size)
  tokens, mask, positions = left_pad(prompts, model_cfg.seq_len, cfg)
  decode = jax.jit(decoding.make_decoder(model_cfg, cfg))
  generated, lengths = jax.device_get(decode(params, tokens, mask, positions,
                                             decoding.StopSequences.none(model_cfg.vocab_size),
                                             np.ones(len(prompts), bool),
                                             jax.random.key(cfg.seed)))
  return [row[:length].tolist() for row, length in zip(generated, lengths)]


def check_text(prompts: Sequence[str], flag_name: str = "--prompt") -> None:
  """A prompt's bytes that are not UTF-8 (a shell's $'\\xff') reach Python as lone surrogates,
  which no tokenizer encodes."""
  for prompt in prompts:
    raw = os.fsencode(prompt)  # The bytes as given.
    try:
      raw.decode("utf-8")
    except UnicodeDecodeError as e:
      raise UserError(f"{flag_name} {raw!r} is not UTF-8 text (byte {e.start}, "
                      f"{raw[e.start]:#04x}: {e.reason})") from None


def chat_prompts(template, tokenizer, prompts: Sequence[str], system: str
                 ) -> tuple[list[str], tuple[int, ...]]:
  """Each prompt as a user message (after a system one, if given) rendered with the generation
  prompt, as transformers' apply_chat_template(add_generation_prompt=True) renders it; and the
  ids a reply ends at: the EOS, and the end-of-turn token a chat dataset weighs after each reply
  (data/chat.py)."""
  head = [{"role": "system", "content": system}] if system else []
  rendered = [template.render(head + [{"role": "user", "content": prompt}], True, "--prompt")
              for prompt in prompts]
  text = template.end_of_turn(head + [{"role": "user", "content": prompts[0]},
                                      {"role": "assistant", "content": ""}], "--prompt")
  end_of_turn = tokenizer.encode(text).tolist()
  if len(end_of_turn) > 1:  # None: a template that writes nothing after a reply.
    raise UserError(f"the chat template's end-of-turn {text!r} (what it writes after a reply) is "
                    f"not one token of the run's tokenizer, so no reply can stop at it")
  return rendered, tuple(sorted({tokenizer.eos_id, *end_of_turn}))


def encode(tokenizer, prompts: Sequence[str], bos: bool) -> list[list[int]]:
  """Each prompt's tokens, after an EOS with `bos`: the loader puts one after every document,
  so each document the model trained on began after it (with data.document_masking, as the
  first token it could see, at position 0)."""
  return [[tokenizer.eos_id] * bos + tokenizer.encode(p).tolist() for p in prompts]


def main(argv: list[str]) -> None:
  del argv
  flag = flags.FLAGS
  cfg = SamplingConfig(flag.max_new_tokens, flag.temperature, flag.top_k, flag.top_p, flag.seed,
                       flag.long_prompt)
  cli.quiet_orbax()
  backend.skip_absent_tpu()
  try:
    if not flag.prompt:
      raise UserError("give at least one --prompt")
    for name in ("system", "chat_template"):
      if flag[name].value and not flag.chat:
        raise UserError(f"--{name} needs --chat")
    check_text(flag.prompt)
    check_text([flag.system], "--system")
    check_ranges(cfg)
    workdir = paths.resolve(flag.workdir, "--workdir")
    model_cfg, params, saved = run_params(workdir)
    tokenizer = trained.run_tokenizer(workdir, saved)
    texts = flag.prompt
    if flag.chat:
      template = trained.chat_template(saved, tokenizer, flag.chat_template)
      texts, stop_ids = chat_prompts(template, tokenizer, flag.prompt, flag.system)
      cfg = dataclasses.replace(cfg, stop_ids=stop_ids)
    prompts = encode(tokenizer, texts, bos=not flag.no_bos)
    for prompt, continuation in zip(flag.prompt, generate(model_cfg, params, prompts, cfg)):
      reply = tokenizer.decode(continuation)
      print(f"--- {prompt!r}\n{reply if flag.chat else prompt + reply}")
  except UserError as e:
    exit_with_error(str(e))


if __name__ == "__main__":
  flags.DEFINE_string("workdir", None, "A training run's workdir.", required=True)
  flags.DEFINE_multi_string("prompt", [], "A prompt; repeat the flag for a batch.")
  flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate per prompt.", lower_bound=1)
  flags.DEFINE_float("temperature", 1.0, "0: greedy.", lower_bound=0)
  flags.DEFINE_integer("top_k", 0, "Sample among the k likeliest tokens (0: all).", lower_bound=0)
  flags.DEFINE_float("top_p", 1.0, "Sample among the likeliest tokens that reach this "
                     "probability (1: all).", lower_bound=0, upper_bound=1)
  flags.DEFINE_integer("seed", 0, "Sampling seed.")
  flags.DEFINE_enum("long_prompt", "error", ["error", "truncate"],
                    "A prompt too long for seq_len - max_new_tokens: refuse it, or keep its end.")
  flags.DEFINE_bool("no_bos", False, "Feed each prompt alone, not after the EOS that began "
                    "every training document.")
  flags.DEFINE_bool("chat", False, "Each prompt is a user message, rendered with the run's chat "
                    "template; print the reply, up to the template's end-of-turn token or the EOS.")
  flags.DEFINE_string("system", "", "--chat: a system message before each prompt.")
  flags.DEFINE_string("chat_template", "", "--chat: a Jinja chat template file; default: the one "
                      "the run's chat datasets were prepared with, else the tokenizer's own.")
  app.run(main, flags_parser=cli.parse_flags)
