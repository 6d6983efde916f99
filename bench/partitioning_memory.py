"""Per-device memory and step time of each mesh layout, on 8 devices.

    python bench/partitioning_memory.py [--num_layers=4 --hidden_dim=256 ...]
    python bench/partitioning_memory.py --experts=8   # A Mixtral: expert parallelism.
    python bench/partitioning_memory.py --optimizer=muon  # What Muon's gathers cost.

On a CPU box it fakes 8 devices. For each layout it prints the per-device
bytes of parameters and optimizer state (from the shardings), the compiled
train step's temp bytes (XLA's memory analysis), the bytes its all-gathers
produce on each device, and the median step time.
With --experts, the model is a Mixtral of that many experts (2 per token) and
the layouts compare replicated experts with experts split over an expert axis.
Uses only jax, flax and optax: no TensorFlow, no data files.
"""
import argparse
import dataclasses
import os
import re

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # pylint: disable=g-import-not-at-top

import numpy as np  # pylint: disable=g-import-not-at-top

from common import DATA_PARALLEL, OPTIMIZER, compile_train_step, run_config  # pylint: disable=g-import-not-at-top
from levanter_flax import models  # pylint: disable=g-import-not-at-top
from levanter_flax.optim import optimizers
from levanter_flax.parallel import partitioning
from levanter_flax.models.gpt2 import PARTITION_RULES, GPT2Config  # pylint: disable=g-import-not-at-top
from levanter_flax.models.moe import MoeConfig  # pylint: disable=g-import-not-at-top


def _sharding(parameter_axis=None, tensor_parallel=False) -> partitioning.ShardingConfig:
  return dataclasses.replace(
      DATA_PARALLEL, rules=PARTITION_RULES if tensor_parallel else (),
      parameter_axis=parameter_axis, tensor_axis="model" if tensor_parallel else None)


LAYOUTS = {
    "data=8": ((("data", 8),), _sharding()),
    "data=4,model=2 (TP)": ((("data", 4), ("model", 2)), _sharding(tensor_parallel=True)),
    "data=8 ZeRO-3": ((("data", 8),), _sharding(parameter_axis="data")),
    "data=2,model=4 TP+ZeRO-3": ((("data", 2), ("model", 4)),
                                 _sharding(parameter_axis="data", tensor_parallel=True)),
}

MIXTRAL_RULES = models.FAMILIES["mixtral"].partition_rules


def _expert_sharding(tensor_axis=None, parameter_axis=None) -> partitioning.ShardingConfig:
  return dataclasses.replace(DATA_PARALLEL, rules=MIXTRAL_RULES, expert_axis="expert",
                             tensor_axis=tensor_axis, parameter_axis=parameter_axis)


EP_MESH = (("data", 2), ("expert", 4))
MIXTURE_LAYOUTS = {
    "data=8 (experts replicated)": ((("data", 8),), DATA_PARALLEL),
    "data=8 ZeRO-3": ((("data", 8),), _sharding(parameter_axis="data")),
    "data=2,expert=4 (EP)": (EP_MESH, _expert_sharding()),
    # mixtral_8x7b.py's layout: the attention split over the expert axis too.
    "data=2,expert=4 EP+TP": (EP_MESH, _expert_sharding(tensor_axis="expert")),
    "data=2,expert=4 EP+TP+ZeRO-3": (EP_MESH, _expert_sharding("expert", parameter_axis="data")),
}


def gathered_bytes(hlo: str) -> int:
  """The bytes the all-gathers of a compiled (per-device) HLO module produce, each counted once:
  one per sharded weight used in the forward pass, more where XLA gathers again (the backward
  pass, a whole matrix for an optimizer that needs it, like Muon's orthogonalization)."""
  itemsize = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4}
  return sum(itemsize.get(dtype, 4) * int(np.prod([int(n) for n in dims.split(",") if n]))
             for dtype, dims in re.findall(r"= (\w+)\[([\d,]*)\][^ ]* all-gather(?:-start)?\(", hlo))


def measure(device_mesh, sharding, model_cfg: GPT2Config, batch_size: int, num_steps: int,
            optimizer: optimizers.OptimizerConfig = OPTIMIZER) -> dict:
  run = compile_train_step(run_config(model_cfg, batch_size, device_mesh, sharding,
                                      optimizer=optimizer))
  abstract, shardings = run.steps.abstract_state, run.steps.state_shardings
  return {
      "params": partitioning.per_device_bytes(abstract.params, shardings.params),
      "opt_state": partitioning.per_device_bytes(abstract.opt_state, shardings.opt_state),
      "temp": run.compiled.memory_analysis().temp_size_in_bytes,
      "gathered": gathered_bytes(run.compiled.as_text()),
      "step_s": run.median_seconds(num_steps),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--num_layers", type=int, default=4)
  parser.add_argument("--hidden_dim", type=int, default=256)
  parser.add_argument("--num_heads", type=int, default=4)
  parser.add_argument("--seq_len", type=int, default=256)
  parser.add_argument("--vocab_size", type=int, default=8192)
  parser.add_argument("--batch_size", type=int, default=16)
  parser.add_argument("--num_steps", type=int, default=3)
  parser.add_argument("--experts", type=int, default=0, help="> 0: a Mixtral with this many")
  parser.add_argument("--optimizer", default=OPTIMIZER.name, choices=list(optimizers.OPTIMIZERS))
  parser.add_argument("--layouts", default="", help="Comma-separated layout names; all if empty")
  args = parser.parse_args()
  optimizer = dataclasses.replace(OPTIMIZER, name=args.optimizer)
  sizes = dict(vocab_size=args.vocab_size, seq_len=args.seq_len, num_layers=args.num_layers,
               num_heads=args.num_heads, hidden_dim=args.hidden_dim)
  if args.experts:
    model_cfg = models.FAMILIES["mixtral"].config(
        num_kv_heads=args.num_heads, intermediate_dim=2 * args.hidden_dim,
        moe=MoeConfig(num_experts=args.experts),
        **sizes)
  else:
    model_cfg = GPT2Config(**sizes)
  print(f"{jax.device_count()} x {jax.devices()[0].platform}; {model_cfg}; batch {args.batch_size}; "
        f"{args.optimizer}")
  mib = lambda n: f"{n / 2**20:9.2f}"
  print(f"{'layout':28s} {'params MiB':>10s} {'opt MiB':>9s} {'temp MiB':>9s} {'gathered MiB':>12s} "
        f"{'step s':>7s}")
  baseline = None
  layouts = MIXTURE_LAYOUTS if args.experts else LAYOUTS
  chosen = [n.strip() for n in args.layouts.split(",") if n.strip()] or list(layouts)
  for name in chosen:
    device_mesh, sharding = layouts[name]
    r = measure(device_mesh, sharding, model_cfg, args.batch_size, args.num_steps, optimizer)
    baseline = baseline or r["params"] + r["opt_state"]
    print(f"{name:28s} {mib(r['params']):>10s} {mib(r['opt_state']):>9s} {mib(r['temp']):>9s} "
          f"{mib(r['gathered']):>12s} {r['step_s']:7.3f}   "
          f"state x{(r['params'] + r['opt_state']) / baseline:.3f}")


if __name__ == "__main__":
  main()
