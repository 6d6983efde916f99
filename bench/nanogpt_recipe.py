"""nanoGPT's Shakespeare-character CPU recipe end to end with our CLI: wall time and eval loss.

    python bench/nanogpt_recipe.py --input=path/to/input.txt [--nanogpt_dir=path/to/nanoGPT]

--input is the tiny Shakespeare text (1,115,394 characters; nanoGPT's
data/shakespeare_char/input.txt); nothing is downloaded. It prepares the
text as bytes (documents split on blank lines, 10% held out), then times
`python -m levanter_flax.main --config=configs/shakespeare_char.py` from
start to exit and prints its final eval loss. With --nanogpt_dir (a checkout
of karpathy/nanoGPT, with PyTorch installed) it also runs nanoGPT's own
README command for the recipe and prints both side by side; nanoGPT is never
a dependency of ours.
"""
import argparse
import json
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
NANOGPT_COMMAND = [
    "train.py", "config/train_shakespeare_char.py", "--device=cpu", "--compile=False",
    "--eval_iters=20", "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4",
    "--n_head=4", "--n_embd=128", "--max_iters=2000", "--lr_decay_iters=2000", "--dropout=0.0"]


def ours(text: pathlib.Path, scratch: pathlib.Path) -> tuple[float, float]:
  """(wall seconds of the training run, its final eval loss)."""
  data = scratch / "shakespeare"
  subprocess.run([sys.executable, "-m", "levanter_flax.commands.prepare", "--source=text",
                  f"--input={text}", "--separator=\\n\\n", "--validation_fraction=0.1",
                  "--tokenizer=byte", "--num_shards=1", f"--output_dir={data}"],
                 cwd=REPO, check=True, capture_output=True)
  start = time.perf_counter()
  subprocess.run([sys.executable, "-m", "levanter_flax.main", "--config=configs/shakespeare_char.py",
                  f"--config.data.dataset={data}", f"--workdir={scratch / 'run'}"],
                 cwd=REPO, check=True, capture_output=True)
  wall = time.perf_counter() - start
  lines = [json.loads(l) for l in (scratch / "run" / "metrics.jsonl").read_text().splitlines()]
  return wall, [l["eval/loss"] for l in lines if "eval/loss" in l][-1]


def nanogpt(checkout: pathlib.Path, text: pathlib.Path, scratch: pathlib.Path) -> tuple[float, float]:
  """(wall seconds of nanoGPT's train.py, its final val loss), in a copy of the checkout."""
  copy = scratch / "nanoGPT"
  shutil.copytree(checkout, copy, ignore=shutil.ignore_patterns(".git", "out-*"))
  data = copy / "data" / "shakespeare_char"
  shutil.copy(text, data / "input.txt")  # prepare.py downloads only when it is missing.
  subprocess.run([sys.executable, "prepare.py"], cwd=data, check=True, capture_output=True)
  start = time.perf_counter()
  out = subprocess.run([sys.executable, *NANOGPT_COMMAND], cwd=copy, check=True,
                       capture_output=True, text=True).stdout
  wall = time.perf_counter() - start
  return wall, float(re.findall(r"val loss ([0-9.]+)", out)[-1])


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--input", type=pathlib.Path, required=True)
  parser.add_argument("--nanogpt_dir", type=pathlib.Path)
  args = parser.parse_args()
  if not args.input.is_file():
    sys.exit(f"nanogpt_recipe: --input {args.input} is not a file")
  with tempfile.TemporaryDirectory() as scratch:
    wall, loss = ours(args.input.resolve(), pathlib.Path(scratch))
    print(f"levanter_flax: {wall:7.1f} s, eval loss {loss:.3f}", flush=True)
    if args.nanogpt_dir:
      their_wall, their_loss = nanogpt(args.nanogpt_dir, args.input.resolve(), pathlib.Path(scratch))
      print(f"nanoGPT:       {their_wall:7.1f} s, val loss {their_loss:.3f}")
      print(f"wall time ratio (ours / nanoGPT): {wall / their_wall:.2f}")


if __name__ == "__main__":
  main()
