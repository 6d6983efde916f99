r"""Text from the latest checkpoint of a run, decoded on a KV cache.

    python -m levanter_flax.sample --workdir=runs/gpt2_nano --prompt="def " --prompt="import " \
        --max_new_tokens=100 --temperature=0.8 --top_k=40

Prompts of different lengths are left-padded into one batch. temperature 0
is greedy decoding; top_k and top_p restrict sampling to the likeliest tokens.
"""
import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from levanter_flax import cli, models, paths
from levanter_flax.checkpoint import run_params
from levanter_flax.errors import UserError, exit_with_error


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  max_new_tokens: int = 64
  temperature: float = 1.0  # 0: greedy.
  top_k: int = 0  # 0: no limit.
  top_p: float = 1.0  # 1: no limit.
  seed: int = 0
  long_prompt: str = "error"  # Or "truncate": keep the prompt's last tokens that fit.


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
  """Each prompt's continuation: max_new_tokens token ids."""
  check_top_k(cfg, model_cfg.vocab_size)
  tokens, mask, positions = left_pad(prompts, model_cfg.seq_len, cfg)
  model = models.build(model_cfg, decode=True)
  cache_len = tokens.shape[1] + cfg.max_new_tokens
  cache = jax.tree.map(
      lambda x: jnp.zeros(x.shape, x.dtype),
      jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((len(prompts), cache_len), jnp.int32))
  )["cache"]
  step = jax.jit(functools.partial(_decode_step, model, cfg=cfg))
  key = jax.random.key(cfg.seed)
  generated = []
  for _ in range(cfg.max_new_tokens):
    key, sample_key = jax.random.split(key)
    next_tokens, cache = step(params, cache, tokens, positions, mask, sample_key)
    generated.append(next_tokens)
    tokens, positions, mask = next_tokens[:, None], positions[:, -1:] + 1, jnp.ones_like(mask[:, :1])
  return np.stack(generated, axis=1).tolist()


def _decode_step(model, params, cache, tokens, positions, token_mask, key, *, cfg):
  logits, variables = model.apply({"params": params, "cache": cache}, tokens, positions=positions,
                                  token_mask=token_mask, mutable=["cache"])
  return choose(logits[:, -1], key, cfg), variables["cache"]


def main(argv: list[str]) -> None:
  del argv
  from levanter_flax.data.tokenizers import load_tokenizer  # pylint: disable=g-import-not-at-top
  flag = flags.FLAGS
  cfg = SamplingConfig(flag.max_new_tokens, flag.temperature, flag.top_k, flag.top_p, flag.seed,
                       flag.long_prompt)
  cli.quiet_orbax()
  try:
    if not flag.prompt:
      raise UserError("give at least one --prompt")
    check_ranges(cfg)
    model_cfg, params, saved = run_params(paths.resolve(flag.workdir, "--workdir"))
    if not isinstance(saved.get("data.tokenizer"), str):
      raise UserError(f"{flag.workdir}/config.json names no data.tokenizer to encode prompts with")
    tokenizer = load_tokenizer(saved["data.tokenizer"])
    prompts = [tokenizer.encode(p).tolist() for p in flag.prompt]
    for prompt, continuation in zip(flag.prompt, generate(model_cfg, params, prompts, cfg)):
      print(f"--- {prompt!r}\n{prompt}{tokenizer.decode(continuation)}")
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
  app.run(main, flags_parser=cli.parse_flags)
