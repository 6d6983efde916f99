"""Step time and optimizer-state memory of each optimizer.name, and of AdamW under
trainer.spike_policy=skip, on one model.

    python bench/optimizers.py [--num_layers=4 --hidden_dim=128 --batch_size=16 --seq_len=128]

Sophia-H adds a Hessian-vector product every hessian_update_interval steps, so
its figure is the mean over whole intervals, not the median. Uses jax, flax
and optax only.
"""
import argparse
import dataclasses
import statistics

import jax

from common import OPTIMIZER, compile_train_step, run_config
from levanter_flax.optim import optimizers
from levanter_flax.models.gpt2 import GPT2Config


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--num_layers", type=int, default=4)
  parser.add_argument("--hidden_dim", type=int, default=128)
  parser.add_argument("--seq_len", type=int, default=128)
  parser.add_argument("--batch_size", type=int, default=16)
  parser.add_argument("--intervals", type=int, default=3, help="Sophia-H intervals to time.")
  args = parser.parse_args()
  cfg = GPT2Config(vocab_size=384, seq_len=args.seq_len, num_layers=args.num_layers,
                   num_heads=max(args.hidden_dim // 32, 1), hidden_dim=args.hidden_dim)
  steps_timed = args.intervals * OPTIMIZER.hessian_update_interval
  print(f"GPT-2 {args.num_layers} layers x {args.hidden_dim}, batch {args.batch_size} x "
        f"{args.seq_len}, {jax.devices()[0].platform}; mean of {steps_timed} steps")
  print(f"{'optimizer':12s} {'ms/step':>9s} {'vs adamw':>9s} {'state bytes/param':>18s}")
  baseline = None
  # Each optimizer, then AdamW wrapped by trainer.spike_policy's window (spikes.py).
  for name, spike_policy in [(name, "none") for name in optimizers.OPTIMIZERS] + [("adamw", "skip")]:
    run = compile_train_step(run_config(cfg, args.batch_size,
                                        optimizer=dataclasses.replace(OPTIMIZER, name=name),
                                        spike_policy=spike_policy))
    run.step_once()  # Warm-up.
    seconds = statistics.mean(run.step_once() for _ in range(steps_timed))
    baseline = baseline or seconds
    num_params = sum(x.size for x in jax.tree.leaves(run.state.params))
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(run.state.opt_state))
    label = name if spike_policy == "none" else f"{name}+{spike_policy}"
    print(f"{label:12s} {1e3 * seconds:9.2f} {seconds / baseline:9.2f} {state_bytes / num_params:18.2f}")


if __name__ == "__main__":
  main()
