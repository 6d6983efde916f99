"""Decoding speed: the engine's KV cache against recomputing the whole sequence for every token.

    python bench/sampling.py [--architecture=gpt2|llama --batch_size=4 --max_new_tokens=96]

Both are greedy on the same random model and must produce the same tokens at full float32
matmul precision (`jax.default_matmul_precision("highest")`): a TPU's default, bfloat16 passes,
rounds the cache's one-token steps and the recompute's whole sequences differently, and a
near tie in the argmax then flips. The timings run at the default. Uses jax and flax only.
"""
import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from levanter_flax import models
from levanter_flax.models.gpt2 import GPT2Config
from levanter_flax.models.llama import LlamaConfig
from levanter_flax.generate.engine import Engine, SamplingParams


def recomputed(model, params, prompts: np.ndarray, new_tokens: int, seq_len: int) -> np.ndarray:
  """Greedy decoding without a cache: the full (padded) sequence through the model per token."""
  forward = jax.jit(lambda p, t: model.apply({"params": p}, t))
  sequence = np.zeros((len(prompts), seq_len), np.int32)
  sequence[:, :prompts.shape[1]] = prompts
  for position in range(prompts.shape[1], prompts.shape[1] + new_tokens):
    logits = forward(params, jnp.asarray(sequence))
    sequence[:, position] = np.asarray(jnp.argmax(logits[:, position - 1], axis=-1))
  return sequence[:, prompts.shape[1]:prompts.shape[1] + new_tokens]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--architecture", default="gpt2", choices=["gpt2", "llama"])
  parser.add_argument("--batch_size", type=int, default=4)
  parser.add_argument("--prompt_len", type=int, default=16)
  parser.add_argument("--max_new_tokens", type=int, default=96)
  args = parser.parse_args()
  sizes = dict(vocab_size=384, seq_len=128, num_layers=4, num_heads=4, hidden_dim=128)
  cfg = (GPT2Config(**sizes) if args.architecture == "gpt2"
         else LlamaConfig(**sizes, num_kv_heads=2, intermediate_dim=352))
  model = models.build(cfg)
  params = models.init_params(cfg, jax.random.key(0))
  prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (args.batch_size, args.prompt_len))
  sampling = SamplingParams(max_tokens=args.max_new_tokens, temperature=0)
  engine = Engine(cfg, params, slots=args.batch_size)
  decoders = {"kv cache": lambda: np.array(
      [r.tokens for r in engine.generate(prompts.tolist(), sampling)]),
              "recompute": lambda: recomputed(model, params, prompts, args.max_new_tokens,
                                              cfg.seq_len)}
  with jax.default_matmul_precision("highest"):
    cached, again = (decode() for decode in decoders.values())
  assert np.array_equal(cached, again), "the two decodings differ"
  engine.warm_up()
  timings = {}
  for name, decode in decoders.items():
    decode()  # Compile.
    start = time.perf_counter()
    decode()
    timings[name] = time.perf_counter() - start
  print(f"{args.architecture} 4 x 128, batch {args.batch_size}, prompt {args.prompt_len}, "
        f"{args.max_new_tokens} new tokens, {jax.devices()[0].platform}")
  for name, seconds in timings.items():
    print(f"{name:10s} {args.batch_size * args.max_new_tokens / seconds:10.1f} tokens/s")
  print(f"kv cache speed-up: {timings['recompute'] / timings['kv cache']:.2f}x")


if __name__ == "__main__":
  main()
