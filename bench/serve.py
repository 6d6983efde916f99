"""Serving: the generation engine under N concurrent clients, against transformers' batched
generate and a static batch (the `sample` command's way), on the same weights.

    python bench/serve.py [--sizes=tiny,100m --concurrency=16 --requests_per_client=2
                           --prompt_len=128 --max_tokens=64 --fixed --http --dtype=float32]

Each client sends its requests one after another (a closed loop). A request is a prompt of
random tokens, prompt_len/2 to prompt_len of them, and generates max_tokens/4 to 7/4 of
max_tokens (no EOS stops it), as requests to a server differ; --fixed: every prompt
prompt_len and every completion max_tokens, static batching's best case. Printed per model:
output tokens/s (each request's own tokens), p50 and p99 time to first token (TTFT), mean
inter-token latency (ITL), and each row's throughput over transformers'. Rows:
  - engine: in-process, clients in threads (no HTTP), --slots = the concurrency;
  - http: the same through `levanter-flax serve` and its OpenAI API, streamed (--http; needs
    the serve extra);
  - static batch: every prompt at once on the engine, then the next batch, as `sample` runs them;
  - transformers: generate() on each batch of prompts, left-padded, to its longest completion
    (TTFT: its prefill, max_new_tokens=1).
Transformers and HTTP rows are skipped where their packages are absent (an accelerator host has
jax and flax alone).
"""
import argparse
import asyncio
import concurrent.futures
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import jax
import numpy as np
from etils import epath

from levanter_flax import models
from levanter_flax.generate.engine import Engine, SamplingParams
from levanter_flax.hf import snapshot
from levanter_flax.models.common import ComputeConfig
from levanter_flax.models.llama import LlamaConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = {
    "tiny": dict(vocab_size=512, hidden_dim=128, intermediate_dim=352, num_layers=4, num_heads=4,
                 num_kv_heads=2),
    # 97M parameters, tied embeddings: GPT-2 small's shape in Llama's blocks.
    "100m": dict(vocab_size=16384, hidden_dim=768, intermediate_dim=2048, num_layers=12,
                 num_heads=12, num_kv_heads=12, tie_word_embeddings=True),
    # Llama 3.2 1B's shape (the GPU check's), 1.24B parameters.
    "1b": dict(vocab_size=128256, hidden_dim=2048, intermediate_dim=8192, num_layers=16,
               num_heads=32, num_kv_heads=8, tie_word_embeddings=True, head_dim=64),
}


def model(size: str, seq_len: int, dtype: str):
  cfg = LlamaConfig(seq_len=seq_len, **SIZES[size],
                    compute=ComputeConfig(dtype=dtype, param_dtype=dtype))
  params = jax.jit(lambda: models.init_params(cfg, jax.random.key(0)))()
  return cfg, params


def summary(name: str, tokens: int, seconds: float, ttfts: list[float], itls: list[float]) -> dict:
  return {"row": name, "tokens/s": tokens / seconds,
          "TTFT p50 s": float(np.percentile(ttfts, 50)),
          "TTFT p99 s": float(np.percentile(ttfts, 99)),
          "ITL ms": 1e3 * statistics.mean(itls) if itls else float("nan")}


def closed_loop(send, requests: list, concurrency: int) -> tuple[float, list, list]:
  """Each of `concurrency` clients sends its share of `requests` ((prompt, max_tokens) pairs)
  one after another through send(prompt, max_tokens) -> token arrival times (from its
  submission); (wall seconds, TTFTs, ITLs)."""
  share = [requests[i::concurrency] for i in range(concurrency)]
  ttfts, itls = [], []

  def client(mine):
    for prompt, max_tokens in mine:
      times = send(prompt, max_tokens)
      ttfts.append(times[0])
      itls.extend(np.diff(times).tolist())
  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
    list(pool.map(client, share))
  return time.perf_counter() - start, ttfts, itls


def engine_row(cfg, params, requests, args) -> dict:
  engine = Engine(cfg, params, slots=args.concurrency, prefill_chunk=args.prefill_chunk)
  engine.warm_up()
  stopped = threading.Event()
  thread = threading.Thread(target=engine.serve_forever, args=(stopped,), daemon=True)
  thread.start()

  def send(prompt, max_tokens):
    start, times = time.perf_counter(), []
    request = engine.submit(prompt, SamplingParams(max_tokens=max_tokens, temperature=0),
                            lambda r: times.append(time.perf_counter()))
    request.wait()
    return [t - start for t in times[:len(request.tokens)]]
  seconds, ttfts, itls = closed_loop(send, requests, args.concurrency)
  stopped.set()
  engine.wake()
  thread.join()
  return summary("engine", sum(m for _, m in requests), seconds, ttfts, itls)


def static_batch_row(cfg, params, requests, args) -> dict:
  """Batches of `concurrency` requests, each batch generated whole before the next starts."""
  engine = Engine(cfg, params, slots=args.concurrency, prefill_chunk=args.prefill_chunk)
  engine.warm_up()
  batches = [requests[i:i + args.concurrency] for i in range(0, len(requests), args.concurrency)]
  ttfts, itls, start = [], [], time.perf_counter()
  for batch in batches:
    began, times = time.perf_counter(), {}
    held = engine.submit_all([p for p, _ in batch],
                             [SamplingParams(max_tokens=m, temperature=0) for _, m in batch],
                             lambda r: times.setdefault(id(r), []).append(time.perf_counter()))
    while not all(r.finished for r in held):
      engine.step()
    for r in held:
      ttfts.append(times[id(r)][0] - began)
      itls.extend(np.diff(times[id(r)]).tolist())
  return summary("static batch", sum(m for _, m in requests), time.perf_counter() - start,
                 ttfts, itls)


def transformers_row(directory, requests, args) -> dict | None:
  try:
    import torch  # pylint: disable=g-import-not-at-top
    import transformers  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(
      torch, args.dtype)).eval()

  def generate(batch, new_tokens):
    longest = max(len(p) for p, _ in batch)
    ids = torch.tensor([[0] * (longest - len(p)) + p for p, _ in batch])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p, _ in batch])
    with torch.no_grad():
      hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                  min_new_tokens=new_tokens, pad_token_id=0)
  batches = [requests[i:i + args.concurrency] for i in range(0, len(requests), args.concurrency)]
  generate(batches[0], 2)  # Warm-up.
  seconds, ttfts, itls = 0.0, [], []
  for batch in batches:
    began = time.perf_counter()
    generate(batch, 1)
    prefill = time.perf_counter() - began
    longest = max(m for _, m in batch)
    began = time.perf_counter()
    generate(batch, longest)  # Every row to the batch's longest completion.
    whole = time.perf_counter() - began
    seconds += whole
    ttfts += [prefill] * len(batch)
    itls += [(whole - prefill) / max(longest - 1, 1)] * len(batch)
  return summary("transformers", sum(m for _, m in requests), seconds, ttfts, itls)


def http_row(directory, requests, args) -> dict | None:
  try:
    import httpx  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  server = subprocess.Popen(
      [sys.executable, "-m", "levanter_flax.commands.serve", f"--init_from_hf={directory}",
       f"--port={port}", f"--slots={args.concurrency}", "--model_name=bench",
       f"--prefill_chunk={args.prefill_chunk}"], cwd=REPO)
  url = f"http://127.0.0.1:{port}/v1/completions"
  try:
    while True:
      try:
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
        break
      except httpx.HTTPError:
        assert server.poll() is None, "the server exited"
        time.sleep(0.5)
    seconds, ttfts, itls = asyncio.run(_http_clients(url, requests, args.concurrency))
  finally:
    server.terminate()
    server.wait()
  return summary("http", sum(m for _, m in requests), seconds, ttfts, itls)


def workload(rng, vocab_size: int, args) -> list[tuple[list[int], int]]:
  """(prompt, max_tokens) of each request (see the module's docstring)."""
  count = args.concurrency * args.requests_per_client
  if args.fixed:
    return [(rng.integers(1, vocab_size, args.prompt_len).tolist(), args.max_tokens)
            for _ in range(count)]
  return [(rng.integers(1, vocab_size, rng.integers(args.prompt_len // 2,
                                                    args.prompt_len + 1)).tolist(),
           int(rng.integers(args.max_tokens // 4, args.max_tokens * 7 // 4 + 1)))
          for _ in range(count)]


async def _http_clients(url: str, requests: list, concurrency: int):
  """closed_loop's clients as coroutines of one event loop (threads would contend for the
  interpreter with each other), streaming; (wall seconds, TTFTs, ITLs)."""
  import httpx  # pylint: disable=g-import-not-at-top
  ttfts, itls = [], []
  async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(
      max_connections=concurrency)) as client:

    async def one(mine):
      for prompt, max_tokens in mine:
        start, times = time.perf_counter(), []
        body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "stream": True, "ignore_eos": True}
        async with client.stream("POST", url, json=body) as response:
          async for line in response.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
              times.append(time.perf_counter() - start)
        ttfts.append(times[0])
        itls.extend(np.diff(times).tolist())
    start = time.perf_counter()
    await asyncio.gather(*(one(requests[i::concurrency]) for i in range(concurrency)))
  return time.perf_counter() - start, ttfts, itls


def write_tokenizer(directory: str, vocab_size: int) -> None:
  """A word-level tokenizer.json of vocab_size tokens, <|endoftext|> first (the server's EOS)."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  vocab = {"<|endoftext|>": 0, **{f"t{i}": i for i in range(1, vocab_size)}}
  tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<|endoftext|>"))
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tokenizer.decoder = tokenizers.decoders.WordPiece(prefix="##")  # Joins words with spaces.
  tokenizer.save(os.path.join(directory, "tokenizer.json"))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", default="tiny,100m")
  parser.add_argument("--concurrency", type=int, default=16)
  parser.add_argument("--requests_per_client", type=int, default=2)
  parser.add_argument("--prompt_len", type=int, default=128)
  parser.add_argument("--max_tokens", type=int, default=64)
  parser.add_argument("--prefill_chunk", type=int, default=128)
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  parser.add_argument("--fixed", action="store_true")
  parser.add_argument("--http", action="store_true")
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  seq_len = args.prompt_len + (args.max_tokens if args.fixed else args.max_tokens * 7 // 4)
  print(f"{args.concurrency} clients x {args.requests_per_client} requests, prompts of "
        f"{'' if args.fixed else f'{args.prompt_len // 2} to '}{args.prompt_len} tokens, "
        f"{'' if args.fixed else f'{args.max_tokens // 4} to {args.max_tokens * 7 // 4}, mean '}"
        f"{args.max_tokens} generated, {args.dtype}, {jax.devices()[0].device_kind}")
  for size in args.sizes.split(","):
    cfg, params = model(size, seq_len, args.dtype)
    requests = workload(rng, cfg.vocab_size, args)
    rows = [engine_row(cfg, params, requests, args),
            static_batch_row(cfg, params, requests, args)]
    with tempfile.TemporaryDirectory() as directory:
      snapshot.save(cfg, jax.device_get(params), epath.Path(directory))
      write_tokenizer(directory, cfg.vocab_size)
      if args.http:
        rows.append(http_row(directory, requests, args))
      rows.append(transformers_row(directory, requests, args))
    rows = [r for r in rows if r]
    base = next((r["tokens/s"] for r in rows if r["row"] == "transformers"), None)
    count = sum(x.size for x in jax.tree.leaves(params)) / 1e6
    print(f"\n{size} ({count:.0f}M parameters)")
    print(f"{'':14s}{'tokens/s':>10s}{'TTFT p50':>10s}{'TTFT p99':>10s}{'ITL ms':>8s}"
          f"{'vs transformers':>17s}")
    for r in rows:
      ratio = f"{r['tokens/s'] / base:.2f}x" if base else "-"
      print(f"{r['row']:14s}{r['tokens/s']:10.1f}{r['TTFT p50 s']:10.3f}{r['TTFT p99 s']:10.3f}"
            f"{r['ITL ms']:8.1f}{ratio:>17s}")


if __name__ == "__main__":
  main()
