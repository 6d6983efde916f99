"""Prompts to completions: prompts checked, encoded (or rendered by a chat template) and
left-padded, sampled with the KV-cached decoding loop. The sample command's library."""
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from levanter_flax.core.errors import UserError
from levanter_flax.generate import decoding
from levanter_flax.generate.decoding import SamplingConfig


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
