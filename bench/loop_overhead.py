"""What the training loop costs on top of the jitted step: `main` against the step alone.

    python bench/loop_overhead.py [--shapes=nano,nanogpt --log_every=1,10 --num_steps=N]

For each shape it times the compiled train step alone on a random batch (as
bench/train_throughput.py does), then runs `python -m levanter_flax.main` on
the built-in corpus for --num_steps steps and reads its step time from the
train/tokens_per_second it logs (the median over log intervals, the compile
step left out). The ratio loop / step is the loop's overhead: the data
pipeline, the host-to-device copies, metrics and every wait on the device.
"nano" is configs/shakespeare_char.py's shape (nanoGPT's CPU recipe) and
"nanogpt" configs/nanogpt_cpu.py's (nanoGPT's default model at T256, B8).
Needs the full install (TensorFlow for main's input pipeline).
"""
import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parent.parent
# Config and the loop's steps (about 20 s of training each on a 2-core CPU).
SHAPES = {"nano": ("configs/shakespeare_char.py", 300), "nanogpt": ("configs/nanogpt_cpu.py", 40)}


def pure_step_seconds(config_file: str, num_steps: int) -> float:
  """The jitted step alone, in a fresh process: bench/train_throughput.py's figure."""
  out = subprocess.run(
      [sys.executable, "bench/train_throughput.py", f"--config={config_file}",
       f"--num_steps={num_steps}", "--matmul_size=256"],
      cwd=REPO, capture_output=True, text=True, check=True).stdout
  line = next(l for l in out.splitlines() if l.startswith("compile"))
  return float(line.split("step ")[1].split(" ms")[0]) / 1e3


def loop_step_seconds(config_file: str, num_steps: int, log_every: int, cache_dir: str) -> float:
  """main's median step time over log intervals, from its metrics.jsonl."""
  with tempfile.TemporaryDirectory() as workdir:
    subprocess.run(
        [sys.executable, "-m", "levanter_flax.main", f"--config={config_file}",
         f"--workdir={workdir}", f"--config.trainer.num_train_steps={num_steps}",
         f"--config.trainer.log_every_steps={log_every}",
         f"--config.trainer.eval_every_steps={num_steps}",
         f"--config.checkpoint.every_steps={num_steps}",
         "--config.data.dataset=stdlib", f"--config.data.cache_dir={cache_dir}"],
        cwd=REPO, capture_output=True, text=True, check=True)
    lines = [json.loads(l) for l in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]
  rates = [l["train/tokens_per_second"] for l in lines if "train/tokens_per_second" in l]
  first_log = next(l for l in lines if "data/tokens" in l)
  tokens_per_step = first_log["data/tokens"] / first_log["step"]
  return tokens_per_step / statistics.median(rates[1:])  # The first interval has the compile.


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--num_steps", type=int, default=0, help="0: the shape's own")
  parser.add_argument("--shapes", default="nano,nanogpt")
  parser.add_argument("--log_every", default="1,10")
  args = parser.parse_args()
  cache_dir = tempfile.mkdtemp(prefix="loop_overhead-")
  print(f"{'shape':8s} {'step ms':>8s} " + " ".join(
      f"{'loop ms (log ' + n + ')':>18s} {'ratio':>6s}" for n in args.log_every.split(",")))
  for shape in args.shapes.split(","):
    config_file, num_steps = SHAPES[shape]
    step = pure_step_seconds(config_file, 10)
    cells = []
    for log_every in args.log_every.split(","):
      loop = loop_step_seconds(config_file, args.num_steps or num_steps, int(log_every), cache_dir)
      cells.append(f"{loop * 1e3:18.1f} {loop / step:6.2f}")
    print(f"{shape:8s} {step * 1e3:8.1f} " + " ".join(cells), flush=True)


if __name__ == "__main__":
  main()
