"""Generation against the memory roofline: the engine's decode steps and prefill on one device.

    python bench/decode_roofline.py [--shape=llama_0.47b,qwen2_0.5b --slots=16,64,128
                                     --prompt_len=512 --new_tokens=256 --cache_dtype=auto
                                     --decode_steps=1,8]

A decode step must at least read the weights once (bfloat16 here; an untied input embedding
only its slots' rows) and every live key and value of the cache. At the device's HBM
bandwidth that takes `roofline` ms; "of roofline" is that time over the step's measured
median, over the steps in which every slot decodes. The engine reads a power-of-two bucket of
each row, not only its live tokens: that padding counts against it here. Prefill is the time until every request
has its first token, as MFU: 2 FLOPs per weight per prompt token (the embedding lookup
aside) and causal attention's, over the device's bf16 peak.

Each row runs its workload three times, on one engine: the first two compile every step
shape and every change of the cache's rows (the second starts by cutting the first's rows),
the third is timed. Every slot gets a prompt of prompt_len random tokens and greedy-decodes
new_tokens (no stop). The machine allows no sockets, so there is no HTTP here
(bench/serve.py has it). Uses jax and flax only.

With --topology (libtpu installed, no chip needed) nothing runs: the last decode step's
forward (the model, not the sampler) is compiled for that topology's chip, and XLA's count of
the bytes it accesses is printed beside those it must read. The count is XLA's estimate, not a
measurement: for the scatter-written cache it put the 0.47B Llama's steps at 4.2, 7.2 and 11.5
ms at 819 GB/s where a v5e chip took 3.8, 7.3 and 12.4 (16, 64 and 128 slots). Good for
comparing two versions of a step.
"""
import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from levanter_flax import models
from levanter_flax.core import flops
from levanter_flax.core.errors import UserError
from levanter_flax.generate.engine import Engine, SamplingParams
from levanter_flax.models.common import ComputeConfig
from levanter_flax.models.llama import LlamaConfig
from levanter_flax.plan import slices

SHAPES = {
    "tiny": dict(vocab_size=512, hidden_dim=128, intermediate_dim=352, num_layers=2, num_heads=4,
                 num_kv_heads=2),
    # llama.py:1b with 8 layers: the training benchmarks' 0.47B shape.
    "llama_0.47b": dict(vocab_size=32000, hidden_dim=2048, intermediate_dim=5632, num_layers=8,
                        num_heads=32, num_kv_heads=4),
    # Qwen2-0.5B's config.json: 494M parameters, tied embeddings, biases on q, k and v.
    "qwen2_0.5b": dict(architecture="qwen2", vocab_size=151936, hidden_dim=896,
                       intermediate_dim=4864, num_layers=24, num_heads=14, num_kv_heads=2,
                       tie_word_embeddings=True, qkv_bias=True, rope_theta=1e6),
}


def config(shape: str, seq_len: int, cache_dtype: str) -> LlamaConfig:
  return LlamaConfig(seq_len=seq_len, **SHAPES[shape], compute=ComputeConfig(
      dtype="bfloat16", param_dtype="bfloat16", cache_dtype=cache_dtype))


def model(shape: str, seq_len: int, cache_dtype: str):
  cfg = config(shape, seq_len, cache_dtype)
  return cfg, jax.jit(lambda: models.init_params(cfg, jax.random.key(0)))()


def weight_bytes_read(cfg, params, slots: int) -> int:
  """The bytes of the weights a decode step reads: all of them, but only `slots` rows of an
  input embedding the head does not share."""
  total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  if cfg.tie_word_embeddings:
    return total
  table = params["embed_tokens"]["embedding"]
  return total - table.size * table.dtype.itemsize + slots * table.shape[1] * table.dtype.itemsize


def cache_bytes_per_token(cfg) -> int:
  itemsize = jnp.dtype(cfg.compute.dtype if cfg.compute.cache_dtype == "auto"
                       else cfg.compute.cache_dtype).itemsize
  return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize


def prefill_flops(cfg, params, prompts: int, prompt_len: int) -> float:
  """2 per weight per prompt token, but the head's logits only at the prompt's last token (the
  engine's), and causal attention's scores and values."""
  head = cfg.vocab_size * cfg.hidden_dim
  tables = head if cfg.tie_word_embeddings else 2 * head  # The head, and an untied lookup.
  body = sum(x.size for x in jax.tree.leaves(params)) - tables
  attention = 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * prompt_len ** 2 / 2
  return prompts * (2 * body * prompt_len + 2 * head + attention)


def run_workload(engine: Engine, prompts: list[list[int]], new_tokens: int):
  """Every prompt at once, stepped to the end: (seconds until every request has a token, the
  decode steps' [(seconds, live tokens in the cache)]; an engine step that decodes k tokens a
  slot is k decode steps of its time over k, at its mean live tokens)."""
  sampling = SamplingParams(max_tokens=new_tokens, temperature=0)
  requests = [engine.submit(p, sampling) for p in prompts]
  start, prefilled, decodes = time.perf_counter(), None, []
  while engine.busy:
    before = [len(r.tokens) for r in requests]
    t = time.perf_counter()
    engine.step()
    seconds = time.perf_counter() - t
    gained = {len(r.tokens) - b for r, b in zip(requests, before)}
    if prefilled is None and all(r.tokens for r in requests):
      prefilled = time.perf_counter() - start
    elif prefilled is not None and len(gained) == 1 and 0 not in gained:
      k = gained.pop()
      live = sum(len(p) + b for p, b in zip(prompts, before)) + len(prompts) * (k - 1) / 2
      decodes.extend([(seconds / k, live)] * k)
  assert all(len(r.tokens) == new_tokens for r in requests), "a request stopped early"
  return prefilled, decodes


def row(shape: str, slots: int, decode_steps: int, args, bandwidth: float, peak: float) -> dict:
  cfg, params = model(shape, args.prompt_len + args.new_tokens, args.cache_dtype)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, cfg.vocab_size, args.prompt_len).tolist() for _ in range(slots)]
  engine = Engine(cfg, params, slots=slots, prefill_chunk=args.prompt_len,
                  decode_steps=decode_steps)
  for _ in range(2):  # Compiles every shape and resize.
    run_workload(engine, prompts, args.new_tokens)
  prefill_seconds, decodes = run_workload(engine, prompts, args.new_tokens)
  weights = weight_bytes_read(cfg, params, slots)
  per_token = cache_bytes_per_token(cfg)
  step = statistics.median(s for s, _ in decodes)
  roofline = statistics.median((weights + live * per_token) / bandwidth for _, live in decodes)
  return {"shape": shape, "slots": slots, "decode_steps": decode_steps,
          "decode step ms": 1e3 * step,
          "roofline ms": 1e3 * roofline, "of roofline": roofline / step,
          "decode tokens/s": slots / step,
          "prefill s": prefill_seconds,
          "prefill MFU": (prefill_flops(cfg, params, slots, args.prompt_len)
                          / prefill_seconds / peak) if peak else None,
          "weights GB": weights / 1e9,
          "cache GB at the end": slots * (args.prompt_len + args.new_tokens) * per_token / 1e9}


def compiled_row(shape: str, slots: int, args, device) -> dict:
  """The last decode step's forward (every slot's row the whole context long) compiled for
  `device`, no array made: XLA's count of the bytes it accesses against what it must read."""
  length = args.prompt_len + args.new_tokens
  cfg = config(shape, length, args.cache_dtype)
  replicated = NamedSharding(Mesh(np.array([device]), ("data",)), PartitionSpec())
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
                        jax.eval_shape(lambda: models.init_params(cfg, jax.random.key(0))))
  engine = Engine(cfg, None, slots=slots, prefill_chunk=args.prompt_len)
  cost = engine.lowered_decode_forward(params, length, replicated).compile().cost_analysis()
  accessed = (cost[0] if isinstance(cost, list) else cost)["bytes accessed"]
  needed = weight_bytes_read(cfg, params, slots) + slots * length * cache_bytes_per_token(cfg)
  return {"shape": shape, "slots": slots, "cache length": length,
          "XLA's bytes GB": accessed / 1e9, "roofline GB": needed / 1e9,
          "XLA's over roofline": accessed / needed}


def print_table(rows: list[dict]) -> None:
  columns = list(rows[0])
  print(" | ".join(columns))
  for r in rows:
    print(" | ".join("-" if r[c] is None else f"{r[c]:.1%}" if c in ("of roofline", "prefill MFU")
                     else f"{r[c]:,.3f}" if isinstance(r[c], float) else str(r[c])
                     for c in columns))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shape", default="llama_0.47b,qwen2_0.5b")
  parser.add_argument("--slots", default="16,64,128")
  parser.add_argument("--prompt_len", type=int, default=512)
  parser.add_argument("--new_tokens", type=int, default=256)
  parser.add_argument("--cache_dtype", default="auto",
                      choices=["auto", "float32", "bfloat16", "float16"])
  parser.add_argument("--decode_steps", default="1,8",
                      help="the engine's decode_steps, side by side (each its own engine)")
  parser.add_argument("--hbm_bandwidth", type=float, default=0.0,
                      help="bytes/s; 0 looks the device up in flops.HBM_BANDWIDTH")
  parser.add_argument("--topology", default="",
                      help="compile the last decode step's forward for this TPU topology's chip "
                      "(e.g. v5e:1x1) on any host, with libtpu, and print XLA's count of the "
                      "bytes it accesses instead of running the workload")
  args = parser.parse_args()
  shapes_and_slots = [(shape, int(slots)) for shape in args.shape.split(",")
                      for slots in args.slots.split(",")]
  if args.topology:
    try:
      device = slices.devices(args.topology)[0]
    except UserError as e:
      parser.error(str(e))
    print(f"{device.device_kind}, compiled on this host; prompts {args.prompt_len}, "
          f"{args.new_tokens} new tokens, cache {args.cache_dtype}")
    print_table([compiled_row(shape, slots, args, device) for shape, slots in shapes_and_slots])
    return
  device = jax.devices()[0]
  bandwidth = args.hbm_bandwidth or flops.HBM_BANDWIDTH.get(device.device_kind, 0.0)
  if not bandwidth:
    parser.error(f"no HBM bandwidth known for {device.device_kind!r}: pass --hbm_bandwidth")
  peak = flops.peak_flops_per_device(device)
  print(f"{device.device_kind}: HBM {bandwidth / 1e9:,.0f} GB/s, bf16 peak "
        f"{peak / 1e12:,.0f} TFLOP/s; prompts {args.prompt_len}, {args.new_tokens} new tokens, "
        f"cache {args.cache_dtype}")
  print_table([row(shape, slots, int(steps), args, bandwidth, peak)
               for shape, slots in shapes_and_slots for steps in args.decode_steps.split(",")])


if __name__ == "__main__":
  main()
