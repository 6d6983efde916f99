r"""Text from the latest checkpoint of a run, decoded on a KV cache.

    python -m levanter_flax.sample --workdir=runs/gpt2_nano --prompt="def " --prompt="import " \
        --max_new_tokens=100 --temperature=0.8 --top_k=40

Prompts of different lengths are left-padded into one batch. temperature 0
is greedy decoding; top_k and top_p restrict sampling to the likeliest tokens.
Each prompt follows an EOS, as every document the model trained on did
(--no_bos: not), so an empty prompt starts a new document. The tokenizer is
the run's (config.json's data.tokenizer), and must still be the file its
datasets were tokenized with.
"""
import dataclasses
import functools
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from etils import epath

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


def check_text(prompts: Sequence[str]) -> None:
  """A prompt's bytes that are not UTF-8 (a shell's $'\\xff') reach Python as lone surrogates,
  which no tokenizer encodes."""
  for prompt in prompts:
    raw = os.fsencode(prompt)  # The bytes as given.
    try:
      raw.decode("utf-8")
    except UnicodeDecodeError as e:
      raise UserError(f"--prompt {raw!r} is not UTF-8 text (byte {e.start}, {raw[e.start]:#04x}: "
                      f"{e.reason})") from None


def run_tokenizer(workdir: epath.Path, saved: dict):
  """The tokenizer a run trained with: config.json's data.tokenizer, if it is still the file
  its datasets were tokenized with (each manifest records it; the trainer refused any other).

  A file replaced since would encode prompts into ids the model did not learn.
  """
  from levanter_flax.data import manifest, tokenizers  # pylint: disable=g-import-not-at-top
  spec = saved.get("data.tokenizer")
  if not isinstance(spec, str):
    raise UserError(f"{workdir}/config.json names no data.tokenizer to encode prompts with")
  tokenizer = tokenizers.load_tokenizer(spec)
  now = tokenizers.identity(tokenizer)
  entries = saved.get("data.mixture") or [("train", saved.get("data.dataset"), 1.0)]
  for dataset in (dataset for _, dataset, _ in entries if isinstance(dataset, str)):
    try:
      directory = _directory(saved, dataset)
      trained = manifest.manifest_tokenizer(manifest.load_manifest(directory))
    except UserError as e:  # Moved or deleted since: the check is left undone, not the sample.
      logging.warning("Cannot check tokenizer %s against the run's dataset %s: %s", spec, dataset,
                      e)
      continue
    if not trained.matches(now):
      raise UserError(f"tokenizer {spec} is {now.describe()} (vocab {now.vocab_size}), but the "
                      f"run in {workdir} trained on {directory}, tokenized with "
                      f"{trained.describe()} (vocab {trained.vocab_size}): the file changed "
                      f"since; put back the one the run trained with")
  return tokenizer


def _directory(saved: dict, dataset: str) -> epath.Path:
  """Where a dataset of a run's config.json (data.dataset, or one of data.mixture) is."""
  from levanter_flax.data import prepare  # pylint: disable=g-import-not-at-top
  if dataset == "stdlib":
    return prepare.builtin_directory(saved["data.cache_dir"], saved["data.tokenizer"],
                                     saved["data.validation_fraction"],
                                     saved["data.num_train_shards"])
  return paths.resolve(dataset, "data.dataset of the run's config.json")


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
  try:
    if not flag.prompt:
      raise UserError("give at least one --prompt")
    check_text(flag.prompt)
    check_ranges(cfg)
    workdir = paths.resolve(flag.workdir, "--workdir")
    model_cfg, params, saved = run_params(workdir)
    tokenizer = run_tokenizer(workdir, saved)
    prompts = encode(tokenizer, flag.prompt, bos=not flag.no_bos)
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
  flags.DEFINE_bool("no_bos", False, "Feed each prompt alone, not after the EOS that began "
                    "every training document.")
  app.run(main, flags_parser=cli.parse_flags)
