"""Decoding on a KV cache, in one compiled program: the prompt is prefilled, then a
`lax.while_loop` appends one token per iteration until every row has stopped or the budget is
spent. Shared by sample.py (its CLI) and harness.py (lm-eval's generate_until).

A row stops at a token of `stop_ids` (left out of its continuation: the EOS, a chat template's
end-of-turn) or once its newest tokens are one of `stop_sequences` (kept: lm-eval cuts the
text at its stop strings on the host), or at a token that `stop_tokens` marks (one whose text
holds a stop string). Which rows have stopped lives on the device, so stopping costs no wait
per token and the loop ends as soon as all have.
"""
import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from levanter_flax import models


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  max_new_tokens: int = 64
  temperature: float = 1.0  # 0: greedy.
  top_k: int = 0  # 0: no limit.
  top_p: float = 1.0  # 1: no limit.
  seed: int = 0
  long_prompt: str = "error"  # Or "truncate": keep the prompt's last tokens that fit.
  stop_ids: tuple[int, ...] = ()  # A continuation ends before the first of these (--chat).


def choose(logits: jax.Array, key: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """Next tokens [batch] from last-position logits [batch, vocab]."""
  if cfg.temperature == 0:
    return jnp.argmax(logits, axis=-1)
  logits = logits.astype(jnp.float32) / cfg.temperature
  if cfg.top_k:
    kth = jax.lax.top_k(logits, cfg.top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if cfg.top_p < 1:
    ordered = jnp.sort(logits, axis=-1)[:, ::-1]
    cumulative = jnp.cumsum(jax.nn.softmax(ordered, axis=-1), axis=-1)
    # The smallest set whose probability reaches top_p: keep tokens at least as likely as its last.
    last = jnp.sum(cumulative < cfg.top_p, axis=-1, keepdims=True)
    threshold = jnp.take_along_axis(ordered, last, axis=-1)
    logits = jnp.where(logits < threshold, -jnp.inf, logits)
  return jax.random.categorical(key, logits, axis=-1)


@dataclasses.dataclass(frozen=True)
class StopSequences:
  """Token sequences a row stops after, as arrays a compiled loop compares against.

  sequences [n, width]: each right-aligned, -1 before it (a row of -1s matches nothing);
  tokens [vocab]: the single tokens that stop a row.
  """
  sequences: np.ndarray
  tokens: np.ndarray

  @classmethod
  def none(cls, vocab_size: int) -> "StopSequences":
    return cls(np.full((1, 1), -1, np.int32), np.zeros(vocab_size, bool))

  @classmethod
  def of(cls, encoded: list[list[int]], stop_tokens: np.ndarray) -> "StopSequences":
    encoded = [s for s in encoded if s] or [[]]
    width = max(map(len, encoded)) or 1
    sequences = np.full((len(encoded), width), -1, np.int32)
    for row, sequence in enumerate(encoded):
      if sequence:
        sequences[row, width - len(sequence):] = sequence
    return cls(sequences, stop_tokens)


# An argument of the compiled loop: its arrays are traced, not baked in.
jax.tree_util.register_dataclass(StopSequences, data_fields=["sequences", "tokens"],
                                 meta_fields=[])


def make_decoder(model_cfg: Any, cfg: SamplingConfig) -> Callable:
  """decode(params, tokens, token_mask, positions, stop: StopSequences, active, key) ->
  (generated [batch, max_new_tokens], lengths [batch]) for left-padded prompts [batch, length];
  rows not `active` [batch] (a fixed-size batch's padding) count as stopped from the start.

  A row's continuation is generated[row, :lengths[row]]: up to (not including) its first token
  of cfg.stop_ids, and up to (including) the end of a stop sequence. To be jitted by the caller
  (with its shardings); cfg is fixed in it.
  """
  model = models.build(model_cfg, decode=True)
  return functools.partial(_decode, model, cfg)


def _decode(model, cfg: SamplingConfig, params, tokens, token_mask, positions,
            stop: StopSequences, active, key):
  batch = tokens.shape[0]
  max_new = cfg.max_new_tokens
  cache = jax.tree.map(
      lambda x: jnp.zeros(x.shape, x.dtype),
      jax.eval_shape(model.init, jax.random.key(0),
                     jnp.zeros((batch, tokens.shape[1] + max_new), jnp.int32)))["cache"]
  stop_ids = jnp.asarray(cfg.stop_ids or (-1,), jnp.int32)
  sequences = jnp.asarray(stop.sequences)
  matchable = (sequences >= 0).any(axis=1)
  stop_tokens = jnp.asarray(stop.tokens)

  def next_token(cache, tokens, positions, token_mask, key):
    logits, variables = model.apply({"params": params, "cache": cache}, tokens,
                                    positions=positions, token_mask=token_mask, mutable=["cache"])
    return choose(logits[:, -1], key, cfg), variables["cache"]

  def record(carry, index, new):
    """Appends `new` [batch] at `index` and updates which rows have stopped."""
    generated, recent, stopped, lengths = carry
    hit_id = jnp.isin(new, stop_ids)
    lengths = lengths + (~stopped & ~hit_id).astype(jnp.int32)
    recent = jnp.concatenate([recent[:, 1:], new[:, None]], axis=1)
    ends_sequence = ((sequences[None] == recent[:, None]) | (sequences[None] < 0)).all(axis=-1)
    hit_sequence = (ends_sequence & matchable[None]).any(axis=-1) | stop_tokens[new]
    stopped = stopped | hit_id | hit_sequence
    return generated.at[:, index].set(new), recent, stopped, lengths

  key, sample_key = jax.random.split(key)
  first, cache = next_token(cache, tokens, positions, token_mask, sample_key)
  carry = record((jnp.zeros((batch, max_new), jnp.int32),
                  jnp.full((batch, sequences.shape[1]), -1, jnp.int32),
                  ~active, jnp.zeros(batch, jnp.int32)), 0, first)

  def unfinished(loop):
    index, _, _, _, (_, _, stopped, _) = loop
    return (index < max_new) & ~stopped.all()

  def step(loop):
    index, cache, last, key, carry = loop
    key, sample_key = jax.random.split(key)
    position = positions[:, -1:] + index
    new, cache = next_token(cache, last[:, None], position, jnp.ones((batch, 1), bool), sample_key)
    return index + 1, cache, new, key, record(carry, index, new)

  *_, (generated, _, _, lengths) = jax.lax.while_loop(
      unfinished, step, (jnp.asarray(1, jnp.int32), cache, first, key, carry))
  return generated, lengths
