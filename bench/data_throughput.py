"""How fast the input pipeline is alone, and how that compares with what training consumes.

    python bench/data_throughput.py [--dataset=DIR --tokenizer=byte --seq_len=1024 ...]

With no --dataset it uses the built-in stdlib corpus (tokenized into the
cache on first use). It prints tokens/s of the tf.data stream to numpy (one
reader group, and the default 8 read by one process), of the whole
TrainBatches path to jax.Arrays (8 groups, as the trainer reads by
default), of a two-source mixture, the time to the first batch when resuming
at window 0 and at window 10**9, and the tokens/s one host device trains
GPT-2 small (and nano) at, with the ratios.

The one benchmark that needs TensorFlow: the pipeline is what it measures.
"""
import argparse
import os
import time

import jax

from common import compile_train_step, run_config
from levanter_flax.data import DataConfig, loader
from levanter_flax.data.manifest import PreparedDataset
from levanter_flax.data.position import DEFAULT_READER_GROUPS, DataPosition, ReaderGroups
from levanter_flax.models.gpt2 import GPT2Config

GPT2_SMALL = GPT2Config(vocab_size=50257, seq_len=1024, num_layers=12, num_heads=12, hidden_dim=768)
GPT2_NANO = GPT2Config(vocab_size=384, seq_len=128, num_layers=4, num_heads=4, hidden_dim=128)


def tokens_per_second(batches, num_batches: int, warmup: int = 5) -> float:
  """Tokens/s over `num_batches` batches after `warmup` (pipeline fill, first shard decodes)."""
  for _ in range(warmup):
    next(batches)
  start, tokens = time.perf_counter(), 0
  for _ in range(num_batches):
    batch = next(batches)
    tokens += batch["tokens"].size
  jax.block_until_ready(batch)
  return tokens / (time.perf_counter() - start)


def seconds_to_first_batch(sources, position: DataPosition, args) -> float:
  start = time.perf_counter()
  next(loader.train_dataset(sources, seq_len=args.seq_len, local_batch_size=args.batch_size,
                            seed=0, position=position).as_numpy_iterator())
  return time.perf_counter() - start


def trainer_tokens_per_second(model_cfg: GPT2Config, batch_size: int) -> float:
  run = compile_train_step(run_config(model_cfg, batch_size, device_mesh=(("data", 1),)))
  return batch_size * model_cfg.seq_len / run.median_seconds(num_steps=2)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dataset", default="stdlib", help="A prepared dataset directory.")
  parser.add_argument("--tokenizer", default="byte")
  parser.add_argument("--seq_len", type=int, default=1024)
  parser.add_argument("--batch_size", type=int, default=32, help="Per host, as gpt2_small's.")
  parser.add_argument("--num_batches", type=int, default=300)
  parser.add_argument("--train_batch_size", type=int, default=2,
                      help="GPT-2 small's batch when timing its step on this host.")
  args = parser.parse_args()

  cfg = DataConfig(dataset=args.dataset, mixture=(), tokenizer=args.tokenizer, cache_dir="",
                   validation_fraction=0.02, num_train_shards=8, on_corrupt_record="fail")
  sources = loader.load_datasets(cfg)
  mixture = [PreparedDataset("a", sources[0].directory, sources[0].manifest, 0.7),
             PreparedDataset("b", sources[0].directory, sources[0].manifest, 0.3)]
  cores = len(os.sched_getaffinity(0))
  start = DataPosition.start(sources, 1)
  print(f"{sources[0].directory}: seq_len {args.seq_len}, {args.batch_size} sequences per batch, "
        f"{cores} host cores, {jax.devices()[0].platform}")

  dataset = loader.train_dataset(sources, seq_len=args.seq_len, local_batch_size=args.batch_size,
                                 seed=0, position=start)
  numpy_rate = tokens_per_second(dataset.as_numpy_iterator(), args.num_batches)
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  # What one process of a new run reads by default: all 8 reader groups.
  groups = ReaderGroups(DEFAULT_READER_GROUPS, range(DEFAULT_READER_GROUPS))
  arrays = loader.TrainBatches(sources, cfg, seq_len=args.seq_len, local_batch_size=args.batch_size,
                               seed=0, position=start, sharding=sharding,
                               vocab_size=sources[0].manifest["tokenizer"]["vocab_size"],
                               groups=groups)
  array_rate = tokens_per_second((batch for batch, _ in arrays), args.num_batches)
  arrays.close()
  mixed = loader.train_dataset(mixture, seq_len=args.seq_len, local_batch_size=args.batch_size,
                               seed=0, position=DataPosition(0, {}))
  mixture_rate = tokens_per_second(mixed.as_numpy_iterator(), args.num_batches)
  grouped = loader.train_dataset(sources, seq_len=args.seq_len, local_batch_size=args.batch_size,
                                 seed=0, position=start, groups=groups)
  grouped_rate = tokens_per_second(grouped.as_numpy_iterator(), args.num_batches)
  print(f"{'path':44s} {'tokens/s':>14s} {'per core':>12s}")
  for name, rate in (("tf.data, 1 reader group -> numpy", numpy_rate),
                     (f"tf.data, {groups.count} reader groups -> numpy", grouped_rate),
                     (f"TrainBatches, {groups.count} groups -> jax.Array", array_rate),
                     ("mixture of 2 (0.7/0.3), 1 group -> numpy", mixture_rate)):
    print(f"{name:44s} {rate:14,.0f} {rate / cores:12,.0f}")

  far = 10**9
  print(f"first batch at window 0: {seconds_to_first_batch(sources, start, args):.2f} s; "
        f"at window {far:,} (step {far // args.batch_size:,}): "
        f"{seconds_to_first_batch(sources, DataPosition(far, {'train': far}), args):.2f} s")

  for name, model_cfg, batch_size in (("gpt2_small", GPT2_SMALL, args.train_batch_size),
                                      ("gpt2_nano", GPT2_NANO, 16)):
    trained = trainer_tokens_per_second(model_cfg, batch_size)
    print(f"{name} train step on 1 {jax.devices()[0].platform} device: {trained:,.0f} tokens/s; "
          f"loader (to jax.Array) is {array_rate / trained:,.0f}x that")


if __name__ == "__main__":
  main()
