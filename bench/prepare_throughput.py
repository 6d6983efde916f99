"""How fast `prepare` tokenizes a corpus: the local engine with 1 and 2 workers against Beam.

    python bench/prepare_throughput.py [--corpus_mb=1024 --bpe_mb=128 --workdir=/tmp/...]

Writes a synthetic corpus once (the Python stdlib's paragraphs, shuffled and
grouped into 2-8 KB documents, repeated to --corpus_mb) as Parquet and as
.jsonl.zst, 16 files each, and trains a 32k BPE on 16 MB of it. Then it runs
the `prepare` command, as a user would, for each format and tokenizer: the
local engine with 1 and 2 workers, and Beam's FnApiRunner with 2 worker
processes. The byte tokenizer reads the whole corpus, the BPE its first
--bpe_mb (it is ~10x slower). Each engine's fixed cost (start-up, 100 KB of
text) is measured apart and taken out of the steady-state rates.

Prints MB/s and tokens/s, per core, the 1 -> 2 worker scaling, Beam against
the local engine at 2 workers, and how many Dataflow workers would tokenize
10 TB in 6 hours at the measured per-core rate.
"""
import argparse
import dataclasses
import json
import pathlib
import random
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time

import pyarrow
import zstandard
from pyarrow import parquet

REPO = pathlib.Path(__file__).resolve().parent.parent
NUM_FILES = 16
SHARDS = 16
MB = 1 << 20


def stdlib_paragraphs() -> list[str]:
  """Blank-line separated paragraphs of the stdlib's .py files: prose, code and docstrings."""
  paragraphs = []
  for path in sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
    if "site-packages" in path.parts:
      continue
    text = path.read_text(encoding="utf-8", errors="replace")
    paragraphs.extend(p for p in text.split("\n\n") if p.strip())
  return paragraphs


def documents(total_bytes: int, seed: int = 0):
  """Documents of 2-8 KB of shuffled paragraphs, until `total_bytes`."""
  rng = random.Random(seed)
  paragraphs, written = stdlib_paragraphs(), 0
  while written < total_bytes:
    target, parts, size = rng.randint(2048, 8192), [], 0
    while size < target:
      parts.append(rng.choice(paragraphs))
      size += len(parts[-1]) + 2
    document = "\n\n".join(parts)
    written += len(document.encode("utf-8"))
    yield document


def write_corpus(directory: pathlib.Path, total_bytes: int) -> None:
  """NUM_FILES Parquet files and NUM_FILES .jsonl.zst files holding the same documents."""
  (directory / "parquet").mkdir(parents=True)
  (directory / "zst").mkdir()
  stream = documents(total_bytes)
  for i in range(NUM_FILES):
    batch, size = [], 0
    for document in stream:
      batch.append(document)
      size += len(document)
      if size >= total_bytes // NUM_FILES:
        break
    parquet.write_table(pyarrow.table({"text": batch}), directory / "parquet" / f"{i:03d}.parquet",
                        row_group_size=4096)
    with zstandard.ZstdCompressor().stream_writer(
        (directory / "zst" / f"{i:03d}.jsonl.zst").open("wb")) as out:
      for document in batch:
        out.write(json.dumps({"text": document}).encode() + b"\n")


def train_tokenizer(directory: pathlib.Path) -> pathlib.Path:
  from levanter_flax.data.tokenizers import train_bpe  # pylint: disable=g-import-not-at-top
  path = directory / "bpe32k.json"
  train_bpe(documents(16 * MB, seed=1), 32768, path)
  return path


@dataclasses.dataclass
class Run:
  seconds: float
  text_mb: float
  tokens: int


def prepare(inputs: str, kind: str, output: pathlib.Path, tokenizer: str, engine: str,
            workers: int, validation_fraction: float = 0.01) -> Run:
  shutil.rmtree(output, ignore_errors=True)
  command = [sys.executable, "-m", "levanter_flax.prepare", f"--source={kind}", f"--input={inputs}",
             f"--output_dir={output}", f"--tokenizer={tokenizer}", f"--engine={engine}",
             f"--num_workers={workers}", f"--num_shards={SHARDS}", f"--validation_fraction={validation_fraction}"]
  start = time.perf_counter()
  result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
  seconds = time.perf_counter() - start
  if result.returncode:
    sys.exit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
  manifest = json.loads((output / "manifest.json").read_text())
  shards = [s for split in manifest["splits"].values() for s in split]
  shutil.rmtree(output)
  return Run(seconds, sum(s["num_text_bytes"] for s in shards) / MB,
             sum(s["num_tokens"] for s in shards))


def subset(directory: pathlib.Path, kind: str, megabytes: float) -> str:
  """--input for the first files of a format holding about `megabytes` of text (0: all)."""
  files = sorted((directory / kind).iterdir())
  count = max(1, round(megabytes / (_corpus_mb(directory) / len(files)))) if megabytes else 0
  return ",".join(str(f) for f in files[:count or len(files)])


def _corpus_mb(directory: pathlib.Path) -> int:
  return int(directory.name.removeprefix("corpus"))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--corpus_mb", type=int, default=1024)
  parser.add_argument("--bpe_mb", type=int, default=128, help="Of the corpus, for the BPE runs.")
  parser.add_argument("--workdir", default="", help="Keeps the corpus here between runs.")
  args = parser.parse_args()
  workdir = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="prepare_bench-"))
  corpus = workdir / f"corpus{args.corpus_mb}"
  if not corpus.exists():
    start = time.perf_counter()
    write_corpus(workdir / "partial", args.corpus_mb * MB)
    (workdir / "partial").rename(corpus)
    print(f"wrote the corpus in {time.perf_counter() - start:.0f} s")
  bpe = workdir / "bpe32k.json"
  if not bpe.exists():
    start = time.perf_counter()
    train_tokenizer(workdir)
    print(f"trained the 32k BPE on 16 MB in {time.perf_counter() - start:.0f} s")

  engines = [("local", 1), ("local", 2), ("beam", 2)]
  tiny = workdir / "tiny.jsonl.zst"  # 100 KB: what a run costs besides tokenizing.
  tiny.write_bytes(zstandard.compress(b"".join(
      json.dumps({"text": d}).encode() + b"\n" for d in documents(100_000))))
  fixed = {(engine, workers): prepare(str(tiny), "jsonl", workdir / "out", "byte", engine,
                                      workers, validation_fraction=0).seconds
           for engine, workers in engines}
  print("fixed cost (start-up, 100 KB of text): " +
        ", ".join(f"{e} x{w} {s:.1f} s" for (e, w), s in fixed.items()))
  print("| format | tokenizer | engine | workers | text MB | wall s | MB/s | MB/s/core "
        "(steady) | tokens/s/core (steady) |")
  print("|---|---|---|---:|---:|---:|---:|---:|---:|")
  rates = {}
  for kind, source in (("parquet", "parquet"), ("zst", "jsonl")):
    for tokenizer, megabytes in (("byte", 0), (str(bpe), args.bpe_mb)):
      name = "byte" if tokenizer == "byte" else "BPE 32k"
      inputs = subset(corpus, kind, megabytes)
      for engine, workers in engines:
        run = prepare(inputs, source, workdir / "out", tokenizer, engine, workers)
        steady = max(run.seconds - fixed[engine, workers], 1e-9)
        rates[kind, name, engine, workers] = per_core = run.text_mb / steady / workers
        print(f"| {kind} | {name} | {engine} | {workers} | {run.text_mb:.0f} | {run.seconds:.1f} | "
              f"{run.text_mb / run.seconds:.1f} | {per_core:.1f} | "
              f"{run.tokens / steady / workers / 1e6:.2f}M |", flush=True)

  print()
  for (kind, name, engine, workers), per_core in rates.items():
    if (engine, workers) != ("beam", 2):
      continue
    one, two = rates[kind, name, "local", 1], rates[kind, name, "local", 2]
    scaling, beam_vs_local = 2 * two / one, per_core / two
    # Dataflow runs one SDK process per vCPU; n1-standard-4 workers have 4.
    cores = 10e12 / MB / (6 * 3600) / per_core
    print(f"{kind}, {name}: local 1 -> 2 workers {scaling:.2f}x (goal >= 1.8: "
          f"{'met' if scaling >= 1.8 else 'MISSED'}); Beam per core {beam_vs_local:.2f}x local "
          f"(goal >= 0.75: {'met' if beam_vs_local >= 0.75 else 'MISSED'}); 10 TB in 6 h: "
          f"{cores:.0f} cores = {cores / 4:.0f} n1-standard-4 Dataflow workers")


if __name__ == "__main__":
  main()
