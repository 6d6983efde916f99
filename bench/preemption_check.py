"""What agreeing on when to stop or save costs per step, with 2 processes on this host.

    python bench/preemption_check.py [--steps=100 --rounds=3]

Starts two processes joined by jax.distributed (gloo, 1 CPU device each),
compiles a tiny GPT-2's train step (2 layers, width 64, 64 tokens, batch 8:
milliseconds a step, so the host's share shows) data-parallel across them,
and times the same loop of steps, each followed by:
  - nothing (the floor);
  - the all-gather the preemption check used to run after every step (a
    host value through the devices: it waits for the step to finish, so
    dispatch cannot run ahead);
  - jax's preemption sync point, which the check is now (a local read);
  - the time-based checkpoint decision (`Checkpointer.due` with
    checkpoint.every_minutes set): process 0 decides and shares it through
    jax's key-value store.
The modes take turns for several rounds; each one's best round counts.
Prints the mean seconds per step of each, what each adds to the floor, and
what each check costs by itself, called between no steps.
Uses jax, flax, optax and orbax only.
"""
import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time


def measure(process_id: int, address: str, steps: int, rounds: int, checkpoints: str) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(address, 2, process_id)
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  from common import compile_train_step, run_config  # pylint: disable=g-import-not-at-top
  from levanter_flax.checkpoint.store import CheckpointConfig, Checkpointer  # pylint: disable=g-import-not-at-top
  from levanter_flax.models.gpt2 import GPT2Config  # pylint: disable=g-import-not-at-top

  tiny = GPT2Config(vocab_size=384, seq_len=64, num_layers=2, num_heads=4, hidden_dim=64)
  run = compile_train_step(run_config(tiny, batch_size=8, device_mesh=(("data", 2),)))
  checkpointer = Checkpointer(__import__("pathlib").Path(checkpoints),
                              CheckpointConfig(every_steps=10**9, keep=1, every_minutes=10**6))
  step_id = 0

  def all_gather():
    return bool(np.any(multihost_utils.process_allgather(np.array(False))))

  def sync_point():
    return multihost_utils.reached_preemption_sync_point(step_id)

  def time_decision():
    return checkpointer.due(step_id)

  modes = {"no check (floor)": lambda: None, "all-gather per step (before)": all_gather,
           "preemption sync point (after)": sync_point, "time-based save decision": time_decision}
  results = {name: float("inf") for name in modes}
  for _ in range(rounds + 1):  # The first round warms up.
    for name, check in modes.items():
      start = time.perf_counter()
      for _ in range(steps):
        step_id += 1
        run.state, metrics = run.compiled(run.state, run.batch)
        check()
      jax.block_until_ready(metrics)
      results[name] = min(results[name], (time.perf_counter() - start) / steps)
  alone = {}  # Each check by itself, between no steps: what it costs the host.
  for name, check in modes.items():
    start = time.perf_counter()
    for _ in range(steps):
      step_id += 1
      check()
    alone[name] = (time.perf_counter() - start) / steps
  checkpointer.close()
  if process_id == 0:
    floor = results["no check (floor)"]
    print(f"tiny GPT-2, batch 8 over 2 processes x 1 CPU device; best of {rounds} rounds of "
          f"{steps} steps")
    print(f"{'after each step':32s} {'ms/step':>9s} {'added':>9s} {'ratio':>7s} "
          f"{'check alone, us':>16s}")
    for name, seconds in results.items():
      print(f"{name:32s} {1e3 * seconds:9.3f} {1e3 * (seconds - floor):+9.3f} "
            f"{seconds / floor:7.3f} {1e6 * alone[name]:16.1f}")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=100)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--process_id", type=int, default=-1, help="Internal: run as process N.")
  parser.add_argument("--address", default="")
  parser.add_argument("--checkpoints", default="")
  args = parser.parse_args()
  if args.process_id >= 0:
    measure(args.process_id, args.address, args.steps, args.rounds, args.checkpoints)
    return
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{s.getsockname()[1]}"
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
         "JAX_PLATFORMS": "cpu"}
  with tempfile.TemporaryDirectory() as checkpoints:
    processes = [subprocess.Popen([sys.executable, __file__, f"--process_id={i}",
                                   f"--address={address}", f"--steps={args.steps}",
                                   f"--rounds={args.rounds}",
                                   f"--checkpoints={checkpoints}"], env=env,
                                  stderr=subprocess.DEVNULL if i else None) for i in range(2)]
    sys.exit(max(p.wait() for p in processes))


if __name__ == "__main__":
  main()
