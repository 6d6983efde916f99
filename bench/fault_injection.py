"""Fault injection against real training processes: kills, a kill during a save, a corrupted checkpoint.

    python bench/fault_injection.py [--kills=3 --num_steps=24 --seed=0]

Trains a shrunken gpt2_nano once without interruption, then runs each
scenario with the same command in a fresh workdir, hurting it as named, and
restarting the same command until it finishes:
- random kills: SIGKILL at random steps, --kills times over;
- kill during save: a checkpoint every step, SIGKILL at a random moment;
- corrupted checkpoint: SIGKILL, then truncate the newest checkpoint.
A scenario passes when every step's final logged loss and every final
parameter equal the uninterrupted run's exactly. Prints each result and
how many passed; exits 1 if any failed.
"""
import argparse
import json
import pathlib
import random
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import orbax.checkpoint as ocp

REPO = pathlib.Path(__file__).resolve().parent.parent


def command(workdir: pathlib.Path, args, checkpoint_every: int) -> list[str]:
  return [sys.executable, "-m", "levanter_flax.main", f"--config={REPO}/configs/gpt2_nano.py",
          f"--workdir={workdir}", "--config.model.seq_len=64", "--config.model.num_layers=2",
          "--config.model.hidden_dim=64", "--config.trainer.batch_size=8",
          f"--config.trainer.num_train_steps={args.num_steps}", "--config.trainer.log_every_steps=1",
          f"--config.trainer.eval_every_steps={args.num_steps}",
          f"--config.trainer.checkpoint_every_steps={checkpoint_every}",
          "--config.trainer.keep_checkpoints=3", f"--config.data.cache_dir={args.cache_dir}"]


def loss_records(workdir: pathlib.Path) -> list[dict]:
  path = workdir / "metrics.jsonl"
  if not path.exists():
    return []
  records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
  return [r for r in records if "train/loss" in r]


def logged_steps(workdir: pathlib.Path) -> dict[int, float]:
  """Each step's last logged train loss (replayed steps log again)."""
  return {r["step"]: r["train/loss"] for r in loss_records(workdir)}


def run_until(cmd: list[str], workdir: pathlib.Path, step: float) -> None:
  """Starts the command and SIGKILLs it once step `step` is logged (or it ends)."""
  process = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  while process.poll() is None and max(logged_steps(workdir), default=0) < step:
    time.sleep(0.05)
  process.send_signal(signal.SIGKILL)
  process.wait()


def finish(cmd: list[str]) -> None:
  subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def final_params(workdir: pathlib.Path, step: int) -> list[np.ndarray]:
  import jax  # pylint: disable=g-import-not-at-top
  state = ocp.StandardCheckpointer().restore((workdir / "checkpoints" / str(step) / "state").absolute())
  return [np.asarray(x) for x in jax.tree.leaves(state["params"])]


def corrupt_newest(workdir: pathlib.Path) -> None:
  newest = max((p for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()),
               key=lambda p: int(p.name))
  largest = max((p for p in newest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
  largest.write_bytes(largest.read_bytes()[:100])


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--kills", type=int, default=3)
  parser.add_argument("--num_steps", type=int, default=24)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--cache_dir", default="", help="Where the stdlib dataset is cached.")
  args = parser.parse_args()
  rng = random.Random(args.seed)
  root = pathlib.Path(tempfile.mkdtemp(prefix="fault_injection-"))

  def scenario_random_kills(workdir):
    cmd = command(workdir, args, checkpoint_every=2)
    for step in sorted(rng.sample(range(1, args.num_steps), args.kills)):
      run_until(cmd, workdir, step)
    finish(cmd)

  def scenario_kill_during_save(workdir):
    cmd = command(workdir, args, checkpoint_every=1)
    run_until(cmd, workdir, rng.uniform(2, args.num_steps - 2))
    finish(cmd)

  def scenario_corrupted_checkpoint(workdir):
    cmd = command(workdir, args, checkpoint_every=2)
    run_until(cmd, workdir, rng.randrange(6, args.num_steps - 2))
    corrupt_newest(workdir)
    finish(cmd)

  reference = root / "reference"
  finish(command(reference, args, checkpoint_every=2))
  expected_losses, expected_params = logged_steps(reference), final_params(reference, args.num_steps)
  scenarios = {"random kills": scenario_random_kills, "kill during save": scenario_kill_during_save,
               "corrupted checkpoint": scenario_corrupted_checkpoint}
  passed = 0
  for name, scenario in scenarios.items():
    workdir = root / name.replace(" ", "_")
    scenario(workdir)
    losses, params = logged_steps(workdir), final_params(workdir, args.num_steps)
    losses_equal = losses == expected_losses
    params_equal = all(np.array_equal(a, b) for a, b in zip(params, expected_params))
    passed += losses_equal and params_equal
    replayed = len(loss_records(workdir)) - len(losses)
    set_aside = sorted(p.name for p in (workdir / "checkpoints").glob("*.unreadable"))
    print(f"{name:24s} {'PASS' if losses_equal and params_equal else 'FAIL'}: "
          f"{len(losses)} steps' losses {'equal' if losses_equal else 'differ'}, "
          f"final params {'bit-identical' if params_equal else 'differ'} "
          f"({replayed} steps replayed after kills; set aside: {set_aside or 'none'})")
  print(f"{passed}/{len(scenarios)} scenarios passed (workdirs in {root})")
  sys.exit(0 if passed == len(scenarios) else 1)


if __name__ == "__main__":
  main()
