"""GRPO learns the toy task on the CPU: a byte-level nano GPT-2 given a short SFT on two-digit
addition ("37+45=" -> "82"), then trained by GRPO with the exact_match reward; held-out exact
match (greedy, 256 problems the runs never see) before and after, the reward curve, and the
GRPO steps' time split between generation and training.

    python bench/grpo.py [--sft_steps=480 --grpo_steps=300 --learning_rate=5e-4 \
        --prompts_per_step=32 --group_size=8 --workdir=/tmp/grpo_bench]

Both runs are `python -m levanter_flax.main` subprocesses, as a user runs them; this process
reads their metrics.jsonl and loads the checkpoints with the engine (no TensorFlow here). A
workdir that holds finished runs is reused: rerunning with more --grpo_steps trains on.
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parent.parent


def problems(count: int, seed: int) -> list[tuple[str, str]]:
  rng = np.random.default_rng(seed)
  a, b = rng.integers(0, 100, count), rng.integers(0, 100, count)
  return [(f"{x}+{y}=", str(x + y)) for x, y in zip(a, b)]


def digits(completions, answer, **_):
  """Partial credit: the share of the answer's digits the completion has in their places (and 0
  for a completion of another length), plus 1 for an exact answer: a denser signal than exact
  match alone for a model that gets few sums right."""
  scores = []
  for completion, expected in zip(completions, answer):
    got = completion.strip()
    places = sum(a == b for a, b in zip(got, expected)) / len(expected) if len(got) == len(
        expected) else 0.0
    scores.append(places + float(got == expected))
  return scores


def write_data(work: pathlib.Path) -> None:
  if not (work / "sft_data" / "manifest.json").exists():
    with open(work / "sft.jsonl", "w") as f:
      for prompt, answer in problems(40000, 0):
        f.write(json.dumps({"prompt": prompt, "completion": answer}) + "\n")
    subprocess.run([sys.executable, "-m", "levanter_flax.commands.prepare",
                    "--source=prompt_completion", f"--input={work}/sft.jsonl", "--tokenizer=byte",
                    f"--output_dir={work}/sft_data", "--num_shards=2"], check=True, cwd=REPO)
  with open(work / "prompts.jsonl", "w") as f:
    for prompt, answer in problems(4000, 1):
      f.write(json.dumps({"prompt": prompt, "answer": answer}) + "\n")


def train(workdir: pathlib.Path, *flags: str) -> float:
  base = ["--config=gpt2:nano", "--config.data.tokenizer=byte", "--config.model.seq_len=32",
          "--config.trainer.log_every_steps=10"]
  started = time.perf_counter()
  subprocess.run([sys.executable, "-m", "levanter_flax.main", *base, *flags,
                  f"--workdir={workdir}"], check=True, cwd=REPO,
                 env={**os.environ, "PYTHONPATH": str(REPO / "bench")})  # grpo:digits.
  return time.perf_counter() - started


def exact_match(workdir: pathlib.Path) -> float:
  import levanter_flax as lf  # pylint: disable=import-outside-toplevel
  from levanter_flax.generate.engine import Engine, SamplingParams  # pylint: disable=import-outside-toplevel
  run = lf.load(workdir)
  tokenizer = run.tokenizer
  held_out = problems(256, 2)
  prompts = [[tokenizer.eos_id] + tokenizer.encode(p).tolist() for p, _ in held_out]
  engine = Engine(run.model_config, run.params, slots=64, tokenizer=tokenizer)
  got = engine.generate(prompts, SamplingParams(max_tokens=4, temperature=0,
                                                stop_ids=(tokenizer.eos_id,)))
  return float(np.mean([r.text.strip() == answer for r, (_, answer) in zip(got, held_out)]))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--sft_steps", type=int, default=480)
  parser.add_argument("--grpo_steps", type=int, default=300)
  parser.add_argument("--learning_rate", type=float, default=5e-4)
  parser.add_argument("--prompts_per_step", type=int, default=32)
  parser.add_argument("--group_size", type=int, default=8)
  parser.add_argument("--updates_per_batch", type=int, default=1)
  parser.add_argument("--reward", default="grpo:digits", help="exact_match, or grpo:digits "
                      "(this file's partial credit)")
  parser.add_argument("--workdir", default="/tmp/grpo_bench")
  args = parser.parse_args()
  work = pathlib.Path(args.workdir)
  work.mkdir(parents=True, exist_ok=True)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  write_data(work)
  sft, rl = work / f"sft{args.sft_steps}", work / (
      f"grpo_{args.reward.replace(':', '_')}_lr{args.learning_rate}_u{args.updates_per_batch}")
  sft_seconds = train(sft, f"--config.data.dataset={work}/sft_data", "--config.trainer.batch_size=64",
                      f"--config.trainer.num_train_steps={args.sft_steps}",
                      f"--config.checkpoint.every_steps={args.sft_steps}",
                      "--config.optimizer.warmup_steps=20")
  before = exact_match(sft)
  grpo_seconds = train(
      rl, f"--config.rl.prompts={work}/prompts.jsonl", f"--config.rl.rewards={args.reward}",
      f"--config.rl.group_size={args.group_size}", "--config.rl.max_completion_tokens=4",
      f"--config.rl.updates_per_batch={args.updates_per_batch}",
      f"--config.trainer.batch_size={args.prompts_per_step * args.group_size}",
      f"--config.trainer.num_train_steps={args.grpo_steps}",
      f"--config.checkpoint.every_steps={args.grpo_steps}",
      f"--config.checkpoint.load_path={sft}/checkpoints/{args.sft_steps}",
      f"--config.optimizer.learning_rate={args.learning_rate}", "--config.optimizer.warmup_steps=10")
  after = exact_match(rl)
  logged = [json.loads(line) for line in open(rl / "metrics.jsonl")]
  curve = [(m["step"], m["rl/reward_mean"]) for m in logged if "rl/reward_mean" in m]
  steps = [m for m in logged if "train/data_wait_seconds" in m]
  wait = np.mean([m["train/data_wait_seconds"] for m in steps])
  tokens_per_step = args.prompts_per_step * args.group_size * 32  # Rows of seq_len 32.
  step_seconds = np.mean([tokens_per_step / m["train/tokens_per_second"] for m in steps])
  print(f"SFT: {args.sft_steps} steps in {sft_seconds:.0f} s; held-out exact match {before:.1%}")
  print(f"GRPO: {args.grpo_steps} steps in {grpo_seconds:.0f} s; held-out exact match {after:.1%} "
        f"({100 * (after - before):+.1f} points)")
  print("reward (mean over each logged interval's completions): " +
        ", ".join(f"{s}: {r:.3f}" for s, r in curve))
  print(f"a GRPO step: {step_seconds:.3f} s, generation {wait:.3f} s ({wait / step_seconds:.0%}), "
        f"training and the rest {step_seconds - wait:.3f} s; generation "
        f"{np.mean([m['rl/generation_tokens_per_second'] for m in steps]):.0f} completion tokens/s, "
        f"training {tokens_per_step / (step_seconds - wait):.0f} tokens/s (prompt, completion and "
        f"padding: rows of 32)")


if __name__ == "__main__":
  main()
