"""Compiled temp memory and step time of each remat policy and accumulation 1/2/4/8; or, with
--lora_rank, the optimizer state of LoRA against full fine-tuning.

    python bench/memory.py [--num_layers=12 --batch_size=8 --num_steps=1 --skip_timing]
    python bench/memory.py --lora_rank=8  # llama_1b's shape, from abstract shapes alone

GPT-2 small's shapes (vocab 50257, width 768, 12 heads, seq 1024) on one
device. Temp bytes come from XLA's memory analysis of the compiled train step
(activations and other scratch; parameters and optimizer state are not temp).
Each remat policy is measured with unrolled and with scanned layers (XLA's
CPU scheduler undoes remat in an unrolled model; a scan keeps it). 'offload'
is measured only where the backend has host memory to offload to.
Uses only jax, flax and optax.
"""
import argparse
import dataclasses
import functools
import math

import jax
import numpy as np

from common import OPTIMIZER, compile_train_step, run_config
from levanter_flax import models
from levanter_flax.optim import optimizers
from levanter_flax.training import step
from levanter_flax.models.common import REMAT_POLICIES, with_compute
from levanter_flax.models.gpt2 import GPT2Config
from levanter_flax.models.llama import LlamaConfig
from levanter_flax.models.lora import LoraConfig

# configs/llama.py:1b's model: TinyLlama-1.1B's shape.
LLAMA_1B = LlamaConfig(vocab_size=32000, seq_len=2048, num_layers=22, num_heads=32,
                       num_kv_heads=4, hidden_dim=2048, intermediate_dim=5632)


def optimizer_state_bytes(model_cfg, optimizer: optimizers.OptimizerConfig = OPTIMIZER) -> int:
  """The optimizer state's bytes for `model_cfg` (LoRA: of the adapters alone), from
  jax.eval_shape of the train state's init: nothing is allocated."""
  model = models.build(model_cfg)
  init = functools.partial(step.init_state, model,
                           optimizers.make_optimizer(optimizer, optimizers.learning_rate_schedule(
                               optimizer, 1000)))
  opt_state = jax.eval_shape(init, jax.random.key(0)).opt_state
  return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(opt_state))


def lora_optimizer_state_fraction(model_cfg, rank: int) -> tuple[int, int]:
  """(LoRA's optimizer state bytes at `rank`, full fine-tuning's), for model_cfg."""
  adapted = dataclasses.replace(model_cfg, lora=LoraConfig(rank=rank))
  return optimizer_state_bytes(adapted), optimizer_state_bytes(model_cfg)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--num_layers", type=int, default=12)
  parser.add_argument("--batch_size", type=int, default=8)
  parser.add_argument("--num_steps", type=int, default=1, help="Timed steps after a warm-up.")
  parser.add_argument("--skip_timing", action="store_true", help="Compile only: bytes, no times.")
  parser.add_argument("--lora_rank", type=int, default=0,
                      help="> 0: llama_1b's AdamW state, LoRA at this rank vs full fine-tuning.")
  args = parser.parse_args()
  if args.lora_rank:
    lora_bytes, full_bytes = lora_optimizer_state_fraction(LLAMA_1B, args.lora_rank)
    print(f"llama_1b AdamW state: LoRA rank {args.lora_rank} {lora_bytes / 2**20:.1f} MiB, full "
          f"{full_bytes / 2**20:.1f} MiB: {100 * lora_bytes / full_bytes:.2f}%")
    return
  base = GPT2Config(vocab_size=50257, seq_len=1024, num_layers=args.num_layers, num_heads=12,
                    hidden_dim=768)
  policies = [p for p in REMAT_POLICIES if p != "offload" or jax.default_backend() != "cpu"]
  cases = [(f"remat={p}{' scan' if scan else ''}", with_compute(base, remat=p, scan_layers=scan), 1)
           for scan in (False, True) for p in policies]
  cases += [(f"accumulation={n}", base, n) for n in (1, 2, 4, 8) if args.batch_size % n == 0]
  print(f"{jax.devices()[0].device_kind}; {base}; batch {args.batch_size}")
  print(f"{'case':44s} {'temp MiB':>10s} {'smaller':>8s} {'step s':>8s} {'slower':>8s}")
  baseline = None
  for name, model_cfg, num_microbatches in cases:
    run = compile_train_step(run_config(model_cfg, args.batch_size, device_mesh=(("data", 1),),
                                        num_microbatches=num_microbatches))
    temp = run.compiled.memory_analysis().temp_size_in_bytes
    seconds = float("nan") if args.skip_timing else run.median_seconds(args.num_steps)
    baseline = baseline or (temp, seconds)
    print(f"{name:44s} {temp / 2**20:10.1f} {baseline[0] / temp:7.2f}x {seconds:8.2f} "
          f"{seconds / baseline[1]:7.2f}x")


if __name__ == "__main__":
  main()
