"""A pipeline's bubble, measured: the step time of 4 stages at M = 4, 8 and 16 microbatches,
side by side with the formula, and the same model data-parallel on the same devices.

    python bench/pipeline_bubble.py [--num_layers=8 --hidden_dim=256 --batch_size=32 --steps=5]

On a CPU box it fakes 8 devices (stage=4 x data=2), which share the host's cores: every stage
computes in every iteration, the bubble's iterations on nothing (SPMD has no idle), so a step
costs about M*R + N - 1 iterations of one microbatch each, (M + N - 1) / M of the useful work;
the bubble's fraction of stage-iterations is (N - 1) / (M + N - 1). The table gives each
layout's median step time and its ratio to the data-parallel step, next to (M + N - 1) / M.
Uses only jax, flax and optax: no TensorFlow, no data files.
"""
import argparse
import dataclasses
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from common import DATA_PARALLEL, compile_train_step, run_config  # pylint: disable=g-import-not-at-top
from levanter_flax.models.common import ComputeConfig  # pylint: disable=g-import-not-at-top
from levanter_flax.models.gpt2 import PARTITION_RULES, GPT2Config  # pylint: disable=g-import-not-at-top
from levanter_flax.models.pipeline import PipelineConfig, Schedule  # pylint: disable=g-import-not-at-top

STAGES = 4


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--num_layers", type=int, default=8)
  parser.add_argument("--hidden_dim", type=int, default=256)
  parser.add_argument("--seq_len", type=int, default=128)
  parser.add_argument("--batch_size", type=int, default=32)
  parser.add_argument("--steps", type=int, default=5, help="Timed steps per layout (median)")
  args = parser.parse_args()
  if args.num_layers % STAGES or args.batch_size % (4 * STAGES * 2):
    parser.error(f"--num_layers must be a multiple of {STAGES} and --batch_size of "
                 f"{4 * STAGES * 2} (the most microbatches, each split over data=2)")
  model = GPT2Config(vocab_size=512, seq_len=args.seq_len, num_layers=args.num_layers,
                     num_heads=4, hidden_dim=args.hidden_dim,
                     compute=ComputeConfig(scan_layers=True))
  sharding = dataclasses.replace(DATA_PARALLEL, rules=PARTITION_RULES)
  baseline = compile_train_step(run_config(model, args.batch_size, (("data", 8),), sharding))
  base_seconds = baseline.median_seconds(args.steps)
  print(f"{'layout':<28} {'step s':>8} {'/ data-parallel':>16} {'(M+N-1)/M':>10} "
        f"{'bubble':>7}")
  print(f"{'data=8':<28} {base_seconds:>8.3f} {1.0:>16.2f} {'':>10} {'':>7}")
  for microbatches in (STAGES, 2 * STAGES, 4 * STAGES):
    schedule = Schedule(STAGES, microbatches, 1)
    run = run_config(model, args.batch_size, (("stage", STAGES), ("data", 2)), sharding,
                     pipeline=PipelineConfig(microbatches=microbatches))
    seconds = compile_train_step(run).median_seconds(args.steps)
    print(f"{f'stage={STAGES} data=2 M={microbatches}':<28} {seconds:>8.3f} "
          f"{seconds / base_seconds:>16.2f} {schedule.iterations / microbatches:>10.2f} "
          f"{schedule.bubble:>7.1%}")


if __name__ == "__main__":
  main()
