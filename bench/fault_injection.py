"""Fault injection against real training processes, hurt the way users and machines hurt them.

    python bench/fault_injection.py [--kills=3 --num_steps=24 --seed=0]

Trains a shrunken gpt2_nano once without interruption, then runs each
scenario in a fresh workdir with the same command, hurting it as named:
- random kills: SIGKILL at random steps, --kills times over;
- kill during save: a checkpoint every step, SIGKILL at a random moment;
- corrupted checkpoint: SIGKILL, then truncate the newest checkpoint;
- torn metrics line: SIGKILL, then a half-written record at the end of metrics.jsonl;
- two runs at once: a second run (another seed) started in the workdir of a running one;
- changed optimizer: SIGKILL, then a restart with another optimizer and start_fresh_if_unusable;
- finished rerun: the finished command run again;
- cut shard: the first train shard to be read cut in half, on_corrupt_record='fail'.
A scenario passes when it ends correct: every step's final logged loss and
every final parameter equal the uninterrupted run's exactly, and each
refusal on the way is one line naming the culprit with exit status 1 (the
cut shard ends in that refusal). Prints a table; exits 1 if any failed.
"""
import argparse
import hashlib
import json
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import orbax.checkpoint as ocp

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# prepare imports TensorFlow only to write a corpus, which exists by then.
from levanter_flax.data import dataset_writer  # pylint: disable=wrong-import-position


def command(workdir: pathlib.Path, args, checkpoint_every: int, *extra: str) -> list[str]:
  return [sys.executable, "-m", "levanter_flax.main", f"--config={REPO}/configs/gpt2_nano.py",
          f"--workdir={workdir}", "--config.model.seq_len=64", "--config.model.num_layers=2",
          "--config.model.hidden_dim=64", "--config.trainer.batch_size=8",
          f"--config.trainer.num_train_steps={args.num_steps}", "--config.trainer.log_every_steps=1",
          f"--config.trainer.eval_every_steps={args.num_steps}",
          f"--config.checkpoint.every_steps={checkpoint_every}",
          "--config.checkpoint.keep=3", f"--config.data.cache_dir={args.cache_dir}",
          *extra]


def loss_records(workdir: pathlib.Path) -> list[dict]:
  path = workdir / "metrics.jsonl"
  if not path.exists():
    return []
  records = []
  for line in path.read_text().splitlines():
    try:
      records.append(json.loads(line))
    except ValueError:  # A torn last line, until the next run cuts it.
      continue
  return [r for r in records if "train/loss" in r]


def logged_steps(workdir: pathlib.Path) -> dict[int, float]:
  """Each step's last logged train loss (replayed steps log again)."""
  return {r["step"]: r["train/loss"] for r in loss_records(workdir)}


def start(cmd: list[str]) -> subprocess.Popen:
  return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)


def run_until(cmd: list[str], workdir: pathlib.Path, step: float) -> None:
  """Starts the command and SIGKILLs it once step `step` is logged (or it ends)."""
  process = start(cmd)
  while process.poll() is None and max(logged_steps(workdir), default=0) < step:
    time.sleep(0.05)
  process.send_signal(signal.SIGKILL)
  process.communicate()


def finish(cmd: list[str]) -> subprocess.CompletedProcess:
  result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
  if result.returncode:
    raise RuntimeError(f"exit {result.returncode}: {last_line(result.stderr)}")
  return result


def last_line(stderr: str) -> str:
  lines = stderr.strip().splitlines()
  return lines[-1] if lines else ""


def refused(result, *fragments: str) -> str:
  """'' if `result` is a one-line refusal holding every fragment, else what is wrong with it."""
  line = last_line(result.stderr)
  if result.returncode != 1 or "Traceback" in result.stderr:
    return f"exit {result.returncode}, expected a one-line refusal: {line[:200]}"
  if not line.startswith("levanter_flax: error: ") or not all(f in line for f in fragments):
    return f"refused, but not as expected: {line[:200]}"
  return ""


def final_params(workdir: pathlib.Path, step: int) -> list[np.ndarray]:
  import jax  # pylint: disable=g-import-not-at-top
  state = ocp.StandardCheckpointer().restore((workdir / "checkpoints" / str(step) / "state").absolute())
  return [np.asarray(x) for x in jax.tree.leaves(state["params"])]


def newest_checkpoint(workdir: pathlib.Path) -> pathlib.Path:
  return max((p for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()),
             key=lambda p: int(p.name))


def corrupt_newest(workdir: pathlib.Path) -> None:
  largest = max((p for p in newest_checkpoint(workdir).rglob("*") if p.is_file()),
                key=lambda p: p.stat().st_size)
  largest.write_bytes(largest.read_bytes()[:100])


def checkpoints_digest(workdir: pathlib.Path) -> str:
  """Of the finished checkpoints: a killed save's temp directory is removed by the next run."""
  digest = hashlib.sha256()
  for path in sorted(p for p in (workdir / "checkpoints").glob("[0-9]*/**/*") if p.is_file()):
    if ".orbax-checkpoint-tmp" not in str(path):
      digest.update(str(path.relative_to(workdir)).encode() + path.read_bytes())
  return digest.hexdigest()


def first_train_shard(dataset: pathlib.Path) -> pathlib.Path:
  """A shard the run reads at once: its 8 reader groups read one of the 8 shards each."""
  return dataset / json.loads((dataset / "manifest.json").read_text())["splits"]["train"][0]["file"]


class Scenarios:
  """Each scenario hurts a run in `workdir` and returns what was wrong on the way ('' if nothing)."""

  def __init__(self, args, rng: random.Random, root: pathlib.Path):
    self.args, self.rng, self.root = args, rng, root

  def random_kills(self, workdir):
    cmd = command(workdir, self.args, 2)
    for step in sorted(self.rng.sample(range(1, self.args.num_steps), self.args.kills)):
      run_until(cmd, workdir, step)
    finish(cmd)
    return ""

  def kill_during_save(self, workdir):
    cmd = command(workdir, self.args, 1)
    run_until(cmd, workdir, self.rng.uniform(2, self.args.num_steps - 2))
    finish(cmd)
    return ""

  def corrupted_checkpoint(self, workdir):
    cmd = command(workdir, self.args, 2)
    run_until(cmd, workdir, self.rng.randrange(6, self.args.num_steps - 2))
    corrupt_newest(workdir)
    finish(cmd)
    return ""

  def torn_metrics_line(self, workdir):
    cmd = command(workdir, self.args, 2)
    run_until(cmd, workdir, self.rng.randrange(3, self.args.num_steps - 2))
    with open(workdir / "metrics.jsonl", "a", encoding="utf-8") as f:
      f.write('{"step": 99, "train/lo')
    finish(cmd)
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    torn = [i for i, line in enumerate(lines) if not line.startswith("{") or not line.endswith("}")]
    return f"metrics.jsonl lines {torn} are not records" if torn else ""

  def two_runs_at_once(self, workdir):
    cmd = command(workdir, self.args, 2)
    first = start(cmd)
    while first.poll() is None and max(logged_steps(workdir), default=0) < 2:
      time.sleep(0.05)
    first.send_signal(signal.SIGSTOP)  # Still running, as far as anyone can tell, however fast.
    second = subprocess.run(command(workdir, self.args, 2, "--config.trainer.seed=1"), cwd=REPO,
                            capture_output=True, text=True)
    first.send_signal(signal.SIGCONT)
    _, stderr = first.communicate()
    if first.returncode:
      return f"the first run failed: {last_line(stderr)}"
    return refused(second, f"workdir {workdir} is in use by pid {first.pid}")

  def changed_optimizer(self, workdir):
    cmd = command(workdir, self.args, 2)
    run_until(cmd, workdir, self.rng.randrange(4, self.args.num_steps - 2))
    before = checkpoints_digest(workdir), (workdir / "config.json").read_bytes()
    changed = subprocess.run(command(workdir, self.args, 2, "--config.optimizer.name=lion",
                                     "--config.checkpoint.start_fresh_if_unusable=True"),
                             cwd=REPO, capture_output=True, text=True)
    problem = refused(changed, "with a different model or optimizer: optimizer.name adamw -> lion")
    if (checkpoints_digest(workdir), (workdir / "config.json").read_bytes()) != before:
      problem = "; ".join(filter(None, [problem, "the checkpoints or config.json changed"]))
    finish(cmd)
    return problem

  def finished_rerun(self, workdir):
    cmd = command(workdir, self.args, 2)
    finish(cmd)
    records, digest = len(loss_records(workdir)), checkpoints_digest(workdir)
    again = finish(cmd)
    if "Already finished" not in again.stderr:
      return f"the rerun did not say it had finished: {last_line(again.stderr)}"
    if len(loss_records(workdir)) != records or checkpoints_digest(workdir) != digest:
      return "the rerun trained or wrote checkpoints"
    return ""

  def cut_shard(self, workdir):
    """Ends in a refusal: there is nothing to compare with the uninterrupted run."""
    dataset = dataset_writer.builtin_dataset(self.args.cache_dir, "byte", 0.02, 8)  # gpt2_nano's.
    copy = self.root / "cut_dataset"
    shutil.copytree(dataset, copy)
    shard = first_train_shard(copy)
    shard.write_bytes(shard.read_bytes()[:shard.stat().st_size // 2])
    result = subprocess.run(command(workdir, self.args, 2, f"--config.data.dataset={copy}"),
                            cwd=REPO, capture_output=True, text=True)
    return refused(result, f"damaged train shard {shard}: it decodes to")


SCENARIOS = ["random_kills", "kill_during_save", "corrupted_checkpoint", "torn_metrics_line",
             "two_runs_at_once", "changed_optimizer", "finished_rerun", "cut_shard"]
REFUSAL_ONLY = ("cut_shard",)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--kills", type=int, default=3)
  parser.add_argument("--num_steps", type=int, default=24)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--cache_dir", default="", help="Where the stdlib dataset is cached.")
  parser.add_argument("--only", default="", help=f"Comma-separated, of {', '.join(SCENARIOS)}.")
  args = parser.parse_args()
  root = pathlib.Path(tempfile.mkdtemp(prefix="fault_injection-"))

  reference = root / "reference"
  finish(command(reference, args, 2))
  expected_losses, expected_params = logged_steps(reference), final_params(reference, args.num_steps)
  scenarios = Scenarios(args, random.Random(args.seed), root)
  names = args.only.split(",") if args.only else SCENARIOS
  rows = []
  for name in names:
    workdir = root / name
    try:
      problem = getattr(scenarios, name)(workdir)
    except RuntimeError as e:
      problem = f"a run failed: {e}"
    detail = "refused in one line, as it should"
    if name not in REFUSAL_ONLY and not problem:
      losses, params = logged_steps(workdir), final_params(workdir, args.num_steps)
      same = losses == expected_losses and all(
          np.array_equal(a, b) for a, b in zip(params, expected_params))
      replayed = len(loss_records(workdir)) - len(losses)
      set_aside = sorted(p.name for p in (workdir / "checkpoints").glob("*.unreadable*"))
      detail = (f"{len(losses)} steps' losses and the final params "
                f"{'bit-identical' if same else 'DIFFER'}; {replayed} steps replayed; set aside: "
                f"{', '.join(set_aside) or 'none'}")
      problem = "" if same else detail
    rows.append((name.replace("_", " "), "FAIL" if problem else "PASS", problem or detail))
  width = max(len(r[0]) for r in rows)
  print(f"{'scenario':{width}}  result  detail")
  for name, result, detail in rows:
    print(f"{name:{width}}  {result:6}  {detail}")
  passed = sum(r[1] == "PASS" for r in rows)
  print(f"{passed}/{len(rows)} scenarios passed (workdirs in {root})")
  sys.exit(0 if passed == len(rows) else 1)


if __name__ == "__main__":
  main()
