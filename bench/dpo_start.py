"""DPO's start and step on one accelerator: the device memory the params take at the start, and
the step's FLOPs as XLA counts them against train/mfu's count.

    python bench/dpo_start.py [--num_layers=8 --batch_size=8 --num_steps=5]

A DPO run (no LoRA) holds the policy's params and the reference model's copy of them. Its start
(training/restore.py) runs the jitted init, which leaves the reference out, then copies the reference from
the params the run starts on, as this does: the device holds the params at most twice, beside
the optimizer's moments. The device's own counters (memory_stats: GPU and TPU; the CPU keeps
none) give the bytes in use after each, and the peak, in units of the params' bytes.
Llama-1B-shaped layers (TinyLlama's width), float32 params. Uses only jax, flax and optax.
"""
import argparse
import time

import jax
import numpy as np

from common import run_config
from levanter_flax.objectives import dpo
from levanter_flax import models
from levanter_flax.parallel import partitioning
from levanter_flax.training import step
from levanter_flax.models.llama import LlamaConfig


def bytes_in_use() -> dict:
  stats = jax.devices()[0].memory_stats() or {}
  return {"in_use": stats.get("bytes_in_use"), "peak": stats.get("peak_bytes_in_use")}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--num_layers", type=int, default=8)
  parser.add_argument("--batch_size", type=int, default=8)
  parser.add_argument("--seq_len", type=int, default=1024)
  parser.add_argument("--num_steps", type=int, default=5)
  args = parser.parse_args()
  model = LlamaConfig(vocab_size=32000, seq_len=args.seq_len, num_layers=args.num_layers,
                      num_heads=32, num_kv_heads=4, hidden_dim=2048, intermediate_dim=5632)
  run = run_config(model, args.batch_size, device_mesh=(("data", 1),))
  partitioner = partitioning.Partitioner(partitioning.make_mesh(run.trainer.device_mesh),
                                         run.sharding)
  with partitioner.activation_context():
    steps = step.build(run, partitioner, eos_id=0, objective=dpo.Dpo(run.dpo))
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(steps.abstract_state.params))
    before = bytes_in_use()
    state = jax.block_until_ready(steps.init(jax.random.key(0)))
    after_init = bytes_in_use()
    copy = jax.jit(step.copied, out_shardings=steps.state_shardings.reference)
    state = state.replace(reference=jax.block_until_ready(copy(state.params)))
    after_copy = bytes_in_use()
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, model.vocab_size, (args.batch_size, args.seq_len), dtype=np.int32)
    codes = np.zeros(tokens.shape, np.float32)
    half = args.seq_len // 2
    codes[:, half // 2:half], codes[:, half + half // 2:] = dpo.CHOSEN, dpo.REJECTED
    tokens[:, half] = 0  # The chosen row's end: its own document, as prepare writes a pair.
    batch = {"tokens": jax.device_put(tokens, steps.batch_sharding),
             "loss_weights": jax.device_put(codes, steps.batch_sharding)}
    compiled = steps.train_step.lower(state, batch).compile()
    cost = compiled.cost_analysis()
    xla_flops = (cost[0] if isinstance(cost, list) else cost or {}).get("flops")
    ours = args.batch_size * args.seq_len * models.flops_per_token(
        model, steps.abstract_state.params, causal=False, reference=True)
    without = args.batch_size * args.seq_len * models.flops_per_token(
        model, steps.abstract_state.params, causal=False)
    times = []
    for _ in range(args.num_steps + 1):
      start = time.perf_counter()
      state, metrics = compiled(state, batch)
      jax.block_until_ready(metrics)
      times.append(time.perf_counter() - start)
  device = jax.devices()[0]
  print(f"device: {device.device_kind}; params {param_bytes / 2**30:.2f} GiB "
        f"({sum(x.size for x in jax.tree.leaves(state.params)):,} float32)")
  if before["in_use"] is None:
    print(f"memory: {device.platform} keeps no memory statistics")
  else:
    share = lambda n: f"{(n - before['in_use']) / param_bytes:.2f}x params"
    print(f"after init (params + AdamW's 2 moments, no reference): {share(after_init['in_use'])}; "
          f"peak {share(after_init['peak'])}")
    print(f"after the reference copy: {share(after_copy['in_use'])}; "
          f"peak {share(after_copy['peak'])}")
  if xla_flops:
    print(f"step FLOPs: XLA {xla_flops:.4g}; ours with the reference forward {ours:.4g} "
          f"(XLA/ours {xla_flops / ours:.3f}); without it {without:.4g} "
          f"(XLA/ours {xla_flops / without:.3f})")
  print(f"DPO loss {float(metrics['train/loss']):.4f} (log 2 = {np.log(2):.4f} at the start); "
        f"median step {np.median(times[1:]) * 1e3:.1f} ms over {args.num_steps} steps")


if __name__ == "__main__":
  main()
