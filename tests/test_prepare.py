"""The prepare step: every source round-trips exactly, restarts keep finished shards, bad input is named."""
import copy
import gzip
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import forkserver
from conftest import REPO, parent_pid, prepare_texts, random_documents
from levanter_flax.data import dataset_writer, shards, sources, tfrecord
from levanter_flax.data.manifest import MANIFEST, load_manifest
from levanter_flax.data.tokenizers import load_tokenizer
from levanter_flax.core.errors import UserError


def read_documents(directory, split=None) -> list[str]:
  """Every document of a prepared dataset, decoded back to text."""
  manifest = load_manifest(directory)
  tokenizer = load_tokenizer("byte")
  splits = [split] if split else list(manifest["splits"])
  return [tokenizer.decode(tokens) for s in splits for shard in manifest["splits"][s]
          for tokens in tfrecord.read_shard(str(directory / shard["file"]), manifest["token_dtype"])]


def prepare_again(directory, **options) -> pathlib.Path:
  """prepare_texts(directory, ...) once more, on its input files as they are now."""
  source = sources.SourceSpec(kind="text", inputs=(str(directory / "input" / "*.txt"),))
  options = {"num_shards": 4, "validation_fraction": 0.2, **options}
  return dataset_writer.prepare_dataset(dataset_writer.PrepareOptions(source=source, output_dir=directory / "data",
                                                        **options))


@pytest.mark.parametrize("vocab_size", [257, 50257, 128_256])
def test_tfrecord_round_trip_is_exact(tmp_path, vocab_size):
  rng = np.random.default_rng(0)
  documents = [rng.integers(0, vocab_size, size=n) for n in (1, 7, 1000, 0, 65)]
  documents[2][:2] = [0, vocab_size - 1]  # Both ends of the id range.
  with tfrecord.ShardWriter(tmp_path / "shard.tfrecord", tfrecord.token_dtype(vocab_size)) as writer:
    for document in documents:
      writer.write(document)
  assert (writer.num_documents, writer.num_tokens) == (5, 1073)
  read = list(tfrecord.read_shard(str(tmp_path / "shard.tfrecord"), tfrecord.token_dtype(vocab_size)))
  assert len(read) == len(documents)
  for got, want in zip(read, documents):
    np.testing.assert_array_equal(got, want)
  assert not list(tmp_path.glob("*.tmp-*"))


def test_text_files_round_trip_exactly(tmp_path):
  texts = random_documents(30) + ["   \n"]  # The blank one is skipped and counted.
  directory = prepare_texts(tmp_path, texts)
  manifest = load_manifest(directory)
  assert sorted(read_documents(directory)) == sorted(texts[:-1])
  validation = read_documents(directory, "validation")
  assert 0 < len(validation) < 15
  assert all(shards.is_validation(f"{texts.index(t):04d}.txt", 0.2) for t in validation)
  assert manifest["source"]["documents"] == 30
  assert manifest["source"]["empty_documents_skipped"] == 1
  assert manifest["tokenizer"] == {"kind": "byte", "sha256": "", "vocab_size": 257, "eos_id": 256}
  train = manifest["splits"]["train"]
  assert len(train) == 4
  assert sum(s["num_text_bytes"] for s in train) == sum(
      len(t.encode()) for t in texts[:-1] if t not in validation)


def test_separator_splits_files_and_jsonl_gz_reads_a_field(tmp_path):
  (tmp_path / "a.txt").write_text("first doc\n\nsecond doc\n\nthird")
  spec = sources.SourceSpec(kind="text", inputs=(str(tmp_path / "a.txt"),), separator="\n\n")
  options = dict(output_dir=tmp_path / "text", validation_fraction=0.0, num_shards=2)
  dataset_writer.prepare_dataset(dataset_writer.PrepareOptions(source=spec, **options))
  assert sorted(read_documents(tmp_path / "text")) == ["first doc", "second doc", "third"]

  records = [{"text": t, "id": i} for i, t in enumerate(random_documents(12))]
  with gzip.open(tmp_path / "a.jsonl.gz", "wt", encoding="utf-8") as f:
    f.write("\n".join(json.dumps(r) for r in records) + "\n\n")
  spec = sources.SourceSpec(kind="jsonl", inputs=(str(tmp_path / "*.jsonl.gz"),))
  dataset_writer.prepare_dataset(dataset_writer.PrepareOptions(source=spec, **options | {
      "output_dir": tmp_path / "jsonl"}))
  assert sorted(read_documents(tmp_path / "jsonl")) == sorted(r["text"] for r in records)


def test_parquet_reads_every_row_group_and_skips_nulls(tmp_path):
  import pyarrow
  from pyarrow import parquet
  texts = random_documents(25)
  column = texts[:10] + [None, ""] + texts[10:]
  table = pyarrow.table({"id": list(range(len(column))), "content": column})
  parquet.write_table(table, tmp_path / "a.parquet", row_group_size=4)  # 7 row groups.
  parquet.write_table(table.slice(0, 3), tmp_path / "b.parquet")
  assert parquet.ParquetFile(tmp_path / "a.parquet").num_row_groups == 7
  spec = sources.SourceSpec(kind="parquet", inputs=(str(tmp_path / "*.parquet"),),
                            text_field="content")
  dataset_writer.prepare_dataset(dataset_writer.PrepareOptions(source=spec, output_dir=tmp_path / "out",
                                                 validation_fraction=0.2, num_shards=3))
  assert sorted(read_documents(tmp_path / "out")) == sorted(texts + texts[:3])
  assert load_manifest(tmp_path / "out")["source"]["empty_documents_skipped"] == 2


def test_zst_text_and_jsonl_are_read_as_they_are_decompressed(tmp_path):
  import zstandard
  texts = random_documents(12)
  jsonl = "\n".join(json.dumps({"text": t}) for t in texts).encode()
  # Two frames, as a file written in parts (The Pile's are) holds.
  (tmp_path / "a.jsonl.zst").write_bytes(
      zstandard.compress(jsonl[:100]) + zstandard.compress(jsonl[100:]))
  (tmp_path / "b.txt.zst").write_bytes(zstandard.compress(texts[0].encode()))
  options = dict(validation_fraction=0.0, num_shards=2)
  dataset_writer.prepare_dataset(dataset_writer.PrepareOptions(source=sources.SourceSpec(
      kind="jsonl", inputs=(str(tmp_path / "*.jsonl.zst"),)), output_dir=tmp_path / "j", **options))
  assert sorted(read_documents(tmp_path / "j")) == sorted(texts)
  dataset_writer.prepare_dataset(dataset_writer.PrepareOptions(source=sources.SourceSpec(
      kind="text", inputs=(str(tmp_path / "*.txt.zst"),)), output_dir=tmp_path / "t", **options))
  assert read_documents(tmp_path / "t") == [texts[0]]


@pytest.mark.parametrize("kind, name, write, fragment", [
    ("parquet", "a.parquet", lambda p: _parquet(p, {"body": ["x"]}),
     "a.parquet: Parquet file has no column 'text'; it has ['body'] (set --text_field)"),
    ("parquet", "a.parquet", lambda p: _parquet(p, {"text": [1, 2]}),
     "a.parquet: column 'text' is int64, not a string"),
    ("parquet", "a.parquet", lambda p: p.write_bytes(b"PAR1 not really"),
     "cannot read Parquet file"),
    ("jsonl", "a.jsonl.zst", lambda p: p.write_bytes(b"\x28\xb5\x2f\xfd garbage"),
     "cannot read input file"),
])
def test_bad_parquet_and_zst_files_are_named(tmp_path, kind, name, write, fragment):
  write(tmp_path / name)
  with pytest.raises(UserError) as error:
    dataset_writer.prepare_dataset(dataset_writer.PrepareOptions(
        source=sources.SourceSpec(kind=kind, inputs=(str(tmp_path / name),)),
        output_dir=tmp_path / "out"))
  assert fragment in str(error.value) and str(tmp_path / name) in str(error.value)
  assert not (tmp_path / "out" / MANIFEST).exists()


def _parquet(path, columns):
  import pyarrow
  from pyarrow import parquet
  parquet.write_table(pyarrow.table(columns), path)


def test_tfds_dataset_is_read_offline_from_its_data_dir(tmp_path):
  import tensorflow_datasets as tfds
  texts = random_documents(10)

  class TinyText(tfds.core.GeneratorBasedBuilder):
    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
      return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
          {"content": tfds.features.Text()}))

    def _split_generators(self, dl_manager):
      del dl_manager
      return {"train": self._generate_examples()}

    def _generate_examples(self):
      for i, text in enumerate(texts):
        yield i, {"content": text}

  TinyText(data_dir=str(tmp_path / "tfds")).download_and_prepare()
  spec = sources.SourceSpec(kind="tfds", inputs=("tiny_text",), text_field="content",
                            tfds_data_dir=str(tmp_path / "tfds"))
  dataset_writer.prepare_dataset(dataset_writer.PrepareOptions(source=spec, output_dir=tmp_path / "out",
                                                 validation_fraction=0.0, num_shards=3))
  assert sorted(read_documents(tmp_path / "out")) == sorted(texts)
  with pytest.raises(UserError, match="TFDS dataset 'tiny_text' has no feature 'text'"):
    dataset_writer.prepare_dataset(dataset_writer.PrepareOptions(
        source=sources.SourceSpec(kind="tfds", inputs=("tiny_text",),
                                  tfds_data_dir=str(tmp_path / "tfds")),
        output_dir=tmp_path / "out2"))


@pytest.mark.slow
def test_parallel_workers_write_the_same_shards(tmp_path):
  texts = random_documents(20)
  one = prepare_texts(tmp_path / "one", texts)
  two = prepare_texts(tmp_path / "two", texts, num_workers=2)
  for shard in load_manifest(one)["splits"]["train"]:
    assert (one / shard["file"]).read_bytes() == (two / shard["file"]).read_bytes()


def test_restart_keeps_finished_shards_and_redoes_the_rest(tmp_path):
  texts = random_documents(20)
  directory = prepare_texts(tmp_path, texts)
  before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in directory.glob("*.tfrecord")}
  # A run killed while writing shard 2: no manifest, no done-marker, a temp file left over.
  (directory / MANIFEST).unlink()
  (directory / "shard-00002-of-00004.done.json").unlink()
  (directory / "train-00002-of-00004.tfrecord").unlink()
  (directory / "train-00002-of-00004.tfrecord.tmp-999").write_bytes(b"partial")
  # And what else a killed run leaves: temp files of a finished shard and of the JSON files.
  (directory / "train-00001-of-00004.tfrecord.tmp-998").write_bytes(b"partial")
  for name in ("shard-00002-of-00004.done.json", MANIFEST, dataset_writer.ARGUMENTS):
    (directory / f"{name}.tmp-999").write_text("{")
  (directory / "notes.tmp-1").write_text("not ours")  # Someone else's file stays.
  prepare_again(tmp_path)
  after = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in directory.glob("*.tfrecord")}
  assert after.keys() == before.keys()
  assert [p.name for p in directory.glob("*.tmp-*")] == ["notes.tmp-1"]
  for name in before:
    assert after[name][1] == before[name][1], name
    assert (after[name][0] == before[name][0]) == ("00002" not in name), name
  assert sorted(read_documents(directory)) == sorted(texts)
  with pytest.raises(UserError, match="prepared with different arguments \\(num_shards\\)"):
    prepare_again(tmp_path, num_shards=5)
  with pytest.raises(UserError, match="prepared with different arguments "
                     "\\(input_files, input_mtimes\\)"):
    prepare_texts(tmp_path, texts + ["one more"])


def test_non_utf8_is_replaced_and_counted_or_refused(tmp_path, caplog):
  (tmp_path / "input").mkdir()
  (tmp_path / "input" / "bad.txt").write_bytes(b"caf\xe9 au lait")
  (tmp_path / "input" / "good.txt").write_text("plain")
  (tmp_path / "input" / "empty.txt").write_text(" \n")
  spec = sources.SourceSpec(kind="text", inputs=(str(tmp_path / "input" / "*.txt"),))
  directory = dataset_writer.prepare_dataset(dataset_writer.PrepareOptions(
      source=spec, output_dir=tmp_path / "out", validation_fraction=0.0))
  assert sorted(read_documents(directory)) == ["caf\ufffd au lait", "plain"]
  assert load_manifest(directory)["source"]["invalid_utf8_documents"] == 1
  warnings = [r.getMessage() for r in caplog.records
              if r.levelname == "WARNING" and r.getMessage().startswith("Prepared")]
  assert warnings == [f"Prepared {directory}: 6 of its 8 train shards are empty; --num_shards=2 or "
                      f"fewer may fill every one",
                      f"Prepared {directory}: 1 documents had invalid UTF-8 (bad bytes replaced by "
                      f"U+FFFD), 1 empty documents were skipped (counts in its manifest.json)"]
  strict = sources.SourceSpec(kind="text", inputs=spec.inputs, on_decode_error="error")
  with pytest.raises(UserError, match=r"bad.txt: invalid UTF-8 at byte 3"):
    dataset_writer.prepare_dataset(dataset_writer.PrepareOptions(source=strict, output_dir=tmp_path / "out2"))


def _jsonl_error(tmp_path, lines: list[str]) -> str:
  tmp_path = tmp_path / str(len(list(tmp_path.iterdir())))
  tmp_path.mkdir()
  (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
  source = sources.SourceSpec(kind="jsonl", inputs=(str(tmp_path / "a.jsonl"),))
  with pytest.raises(UserError) as error:
    dataset_writer.prepare_dataset(dataset_writer.PrepareOptions(source=source, output_dir=tmp_path / "out",
                                                   validation_fraction=0.0))
  return str(error.value)


def test_bad_sources_are_named(tmp_path):
  assert _jsonl_error(tmp_path, ['{"text": "a"}', '{"body": "b"}']) == (
      f"{tmp_path}/0/a.jsonl:2: JSON record has no field 'text' (set --text_field)")
  assert _jsonl_error(tmp_path, ['{"text": "a"}', "{oops}"]).startswith(
      f"{tmp_path}/1/a.jsonl:2: not valid JSON")
  assert _jsonl_error(tmp_path, ['{"text": ""}', '{"text": "  "}']) == (
      f"source {tmp_path}/2/a.jsonl holds no non-empty documents (2 empty ones skipped)")
  with pytest.raises(UserError, match=r"input glob '/nowhere/\*.txt' matches no files"):
    dataset_writer.prepare_dataset(dataset_writer.PrepareOptions(
        source=sources.SourceSpec(kind="text", inputs=("/nowhere/*.txt",)),
        output_dir=tmp_path / "out2"))
  with pytest.raises(UserError, match=r"tokenizer '.*missing.json' is neither 'byte' nor"):
    dataset_writer.prepare_dataset(dataset_writer.PrepareOptions(
        source=sources.SourceSpec(kind="jsonl", inputs=(str(tmp_path / "0" / "a.jsonl"),)),
        output_dir=tmp_path / "out3", tokenizer=str(tmp_path / "missing.json")))
  # Bad input is found before anything is created.
  assert not (tmp_path / "out2").exists() and not (tmp_path / "out3").exists()
  (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(b'{"text": "a"}\n' * 1000)[:60])
  with pytest.raises(UserError, match=f"cannot read input file {tmp_path}/cut.jsonl.gz: "):
    dataset_writer.prepare_dataset(dataset_writer.PrepareOptions(
        source=sources.SourceSpec(kind="jsonl", inputs=(str(tmp_path / "cut.jsonl.gz"),)),
        output_dir=tmp_path / "out4"))


def run_prepare(*args):
  return forkserver.run([sys.executable, "-m", "levanter_flax.commands.prepare", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=300)


def test_a_tokenizer_trained_by_an_older_prepare_is_kept_if_complete(tmp_path):
  """Before tokenizer_sample_bytes, the BPE learnt from the whole train split."""
  options = {"train_tokenizer_vocab_size": 300, "tokenizer_sample_bytes": 2000}
  directory = prepare_texts(tmp_path, random_documents(10), **options)
  assert load_manifest(directory)["tokenizer_training"]["documents"] > 0
  arguments = json.loads((directory / dataset_writer.ARGUMENTS).read_text())
  del arguments["tokenizer_sample_bytes"]
  (directory / dataset_writer.ARGUMENTS).write_text(json.dumps(arguments))
  assert prepare_again(tmp_path, **options) == directory
  (directory / MANIFEST).unlink()
  with pytest.raises(UserError, match="partly prepared by an older prepare"):
    prepare_again(tmp_path, **options)


@pytest.mark.slow
def test_command_line_trains_a_tokenizer_and_names_bad_input(tmp_path):
  (tmp_path / "in").mkdir()
  for i, text in enumerate(random_documents(30)):
    (tmp_path / "in" / f"{i}.txt").write_text(text)
  result = run_prepare("--source=text", f"--input={tmp_path}/in/*.txt", "--train_tokenizer",
                       "--vocab_size=300", f"--output_dir={tmp_path}/out", "--num_shards=2",
                       "--validation_fraction=0.2")
  assert result.returncode == 0, result.stderr[-3000:]
  manifest = load_manifest(tmp_path / "out")
  assert manifest["tokenizer"]["kind"] == "huggingface"
  assert manifest["tokenizer"]["vocab_size"] == 300
  assert manifest["token_dtype"] == "uint16"

  result = run_prepare("--source=jsonl", "--input=/nowhere/*.jsonl", f"--output_dir={tmp_path}/x")
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1] == (
      "levanter_flax: error: input glob '/nowhere/*.jsonl' matches no files")
  assert "Traceback" not in result.stderr
  assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_command_line_separator_keeps_non_ascii_and_names_a_bad_escape(tmp_path):
  (tmp_path / "a.txt").write_text("one§\ntwo✂§\nthrée")
  flags = ["--source=text", f"--input={tmp_path}/a.txt", "--num_shards=1",
           "--validation_fraction=0", "--num_workers=1"]
  result = run_prepare(*flags, "--separator=§\\n", f"--output_dir={tmp_path}/out")
  assert result.returncode == 0, result.stderr[-3000:]
  assert sorted(read_documents(tmp_path / "out")) == ["one", "thrée", "two✂"]
  for separator, reason in (("\\x", "truncated \\xXX escape"),
                            ("✂\\d", "invalid escape sequence '\\d'")):
    result = run_prepare(*flags, f"--separator={separator}", f"--output_dir={tmp_path}/bad")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"levanter_flax: error: --separator={separator}: bad escape ({reason})")
    assert "Traceback" not in result.stderr
  assert not (tmp_path / "bad").exists()


def test_an_input_edited_in_place_is_noticed(tmp_path):
  texts = random_documents(8)
  prepare_texts(tmp_path, texts)
  prepare_again(tmp_path)  # Unchanged inputs: the same dataset.
  edited = tmp_path / "input" / "0003.txt"
  before = edited.stat()
  edited.write_text(texts[3][::-1], encoding="utf-8")  # The same size.
  # File times advance by clock ticks of some milliseconds: an edit made this soon after the
  # first write may not move the mtime, which one made by a person would.
  os.utime(edited, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))
  assert edited.stat().st_size == before.st_size
  with pytest.raises(UserError, match=r"prepared with different arguments \(input_mtimes\)"):
    prepare_again(tmp_path)
  # A directory prepared before mtimes were recorded is checked on its sizes alone.
  arguments = tmp_path / "data" / dataset_writer.ARGUMENTS
  arguments.write_text(json.dumps({k: v for k, v in json.loads(arguments.read_text()).items()
                                   if k != "input_mtimes"}))
  prepare_again(tmp_path)


def test_an_output_dir_inside_the_input_glob_is_no_input(tmp_path):
  """Its shards, matched on a rerun, would change the inputs, which refuses the same command."""
  for name, text in (("a.txt", "one"), ("b.txt", "two")):
    (tmp_path / name).write_text(text)
  everything = sources.SourceSpec(kind="text", inputs=(f"{tmp_path}/**",))
  options = dataset_writer.PrepareOptions(source=everything, output_dir=tmp_path / "out",
                                          validation_fraction=0.0, num_shards=1)
  dataset_writer.prepare_dataset(options)
  dataset_writer.prepare_dataset(options)  # The same command again.
  assert sorted(read_documents(tmp_path / "out")) == ["one", "two"]
  with pytest.raises(UserError, match=f"input glob '{tmp_path}/out/\\*' matches no files outside "
                                      f"--output_dir {tmp_path}/out"):
    dataset_writer.prepare_dataset(dataset_writer.PrepareOptions(
        source=sources.SourceSpec(kind="text", inputs=(f"{tmp_path}/out/*",)),
        output_dir=tmp_path / "out"))


def test_an_empty_split_can_be_fixed_as_the_error_says(tmp_path):
  texts = random_documents(20)
  with pytest.raises(UserError, match=r"gave no validation documents out of 20; adjust "
                                      r"--validation_fraction \(1e-09\)"):
    prepare_texts(tmp_path, texts, validation_fraction=1e-9)
  assert [p.name for p in (tmp_path / "data").iterdir()] == [".lock"]  # No shard of it is kept.
  prepare_again(tmp_path, validation_fraction=0.5)
  assert sorted(read_documents(tmp_path / "data")) == sorted(texts)


def test_mostly_empty_shards_are_warned_of(tmp_path, caplog):
  prepare_texts(tmp_path, ["one", "two", "three"], num_shards=8, validation_fraction=0.0)
  assert f"Prepared {tmp_path / 'data'}: 5 of its 8 train shards are empty; --num_shards=3 or " \
         f"fewer may fill every one" in caplog.text


# A prepare that writes slowly (0.1 s a document) and says when it starts writing shards. (force:
# forked, it finds the root handler orbax's import adds.)
_SLOW_PREPARE = """
import logging, pathlib, sys, time
from levanter_flax.data import dataset_writer, sources, tfrecord
logging.basicConfig(level=logging.INFO, force=True)
write, run_shards = tfrecord.ShardWriter.write, dataset_writer._run_shards
tfrecord.ShardWriter.write = lambda self, *args: (time.sleep(0.1), write(self, *args))
dataset_writer._run_shards = lambda *args: (print("writing", flush=True), run_shards(*args))[1]
dataset_writer.prepare_dataset(dataset_writer.PrepareOptions(
    source=sources.SourceSpec(kind="text", inputs=(sys.argv[1],)),
    output_dir=pathlib.Path(sys.argv[2]), num_shards=4, validation_fraction=0.2), wait=True)
"""


def wait_until(condition, process: subprocess.Popen, timeout: float = 120) -> None:
  deadline = time.monotonic() + timeout
  while not condition():
    assert process.poll() is None, "it ended early"
    assert time.monotonic() < deadline, "timed out"
    time.sleep(0.01)


@pytest.mark.slow
def test_concurrent_prepares_take_turns(tmp_path):
  """A second prepare into a directory being written waits for the first, then finds it done.

  What every trainer process does with the built-in corpus; before the lock,
  the second deleted the first one's temp files and the first failed.
  """
  texts = random_documents(40)
  (tmp_path / "input").mkdir()
  for i, text in enumerate(texts):
    (tmp_path / "input" / f"{i:04d}.txt").write_text(text, encoding="utf-8")
  output = tmp_path / "data"
  command = [sys.executable, "-c", _SLOW_PREPARE, str(tmp_path / "input" / "*.txt"), str(output)]
  run = lambda: forkserver.Popen(command, cwd=REPO, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
  first = run()
  processes = [first]
  try:
    wait_until(lambda: list(output.glob("*.tfrecord.tmp-*")), first)  # The first is writing.
    processes.append(run())
    results = [p.communicate(timeout=300) for p in processes]
  finally:
    for process in processes:
      process.kill()
  for process, (_, stderr) in zip(processes, results):
    assert process.returncode == 0, stderr[-3000:]
  assert [stdout for stdout, _ in results] == ["writing\n", ""]
  assert f"Waiting for pid {first.pid} on {socket.gethostname()} (since " in results[1][1]
  assert sorted(read_documents(output)) == sorted(texts)
  assert not list(output.glob("*.tmp-*"))


# Holds a directory's lock until its stdin closes.
_HOLD_LOCK = """
import pathlib, sys
from levanter_flax.core import locks
lock = locks.DirectoryLock(pathlib.Path(sys.argv[1]), "dataset directory")
lock.acquire()
print("locked", flush=True)
sys.stdin.read()
"""


def test_command_line_refuses_a_directory_another_prepare_is_writing(tmp_path):
  (tmp_path / "a.txt").write_text("one document")
  output = tmp_path / "data"
  output.mkdir()
  holder = forkserver.Popen([sys.executable, "-c", _HOLD_LOCK, str(output)], cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline() == "locked\n"
    result = run_prepare("--source=text", f"--input={tmp_path}/a.txt", f"--output_dir={output}",
                         "--validation_fraction=0", "--num_shards=1")
  finally:
    holder.communicate(timeout=60)  # Closing its stdin ends it.
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1].startswith(
      f"levanter_flax: error: dataset directory {output} is in use by pid {holder.pid} on "
      f"{socket.gethostname()} (since ")
  assert "Traceback" not in result.stderr
  assert [p.name for p in output.iterdir()] == [".lock"]  # Nothing touched.
  # The lock went with its holder.
  dataset_writer.prepare_dataset(dataset_writer.PrepareOptions(
      source=sources.SourceSpec(kind="text", inputs=(str(tmp_path / "a.txt"),)),
      output_dir=output, validation_fraction=0.0, num_shards=1))
  assert read_documents(output) == ["one document"]


def children(pid: int) -> list[int]:
  found = []
  for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
    try:
      parent = parent_pid(int(stat.parent.name))
    except (OSError, IndexError, ValueError):  # Gone meanwhile.
      continue
    if parent == pid:
      found.append(int(stat.parent.name))
  return found


def running(pid: int) -> bool:
  """Not gone, nor a zombie (this machine's init may never reap the orphans)."""
  try:
    return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
  except (OSError, IndexError):
    return False


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="Linux only: PR_SET_PDEATHSIG, and the processes are found in /proc")
@pytest.mark.parametrize("victim", ["parent", "worker"])
def test_a_killed_prepare_or_worker_takes_the_others_with_it(tmp_path, victim):
  """kill -9 of the parent: no orphaned workers; of a worker: one line, not a wait for ever."""
  # Enough documents that a shard takes longer than the wait below: an orphaned worker would
  # write on to the end of its shard, and only then fail to report it.
  (tmp_path / "a.txt").write_text("\n".join(f"document {i}" for i in range(1_000_000)))
  output = tmp_path / "out"
  parent = forkserver.Popen(
      [sys.executable, "-m", "levanter_flax.commands.prepare", "--source=text",
       f"--input={tmp_path}/a.txt",
       "--separator=\\n", f"--output_dir={output}", "--num_shards=8", "--num_workers=2"],
      cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  workers = []
  try:
    # Both workers are writing (their temp files are named by pid): set up, and busy.
    writers = lambda: {int(p.name.rsplit("-", 1)[1]) for p in output.glob("*.tfrecord.tmp-*")}
    wait_until(lambda: len(writers()) == 2, parent)
    workers = children(parent.pid)
    assert writers() <= set(workers)
    os.kill(parent.pid if victim == "parent" else sorted(writers())[0], signal.SIGKILL)
    _, stderr = parent.communicate(timeout=60)
    if victim == "worker":
      assert parent.returncode == 1 and "Traceback" not in stderr, stderr[-3000:]
      assert stderr.strip().splitlines()[-1] == (
          f"levanter_flax: error: a prepare worker died (killed, or out of memory?) while writing "
          f"{output}; its finished shards are kept: run the same command again")
    deadline = time.monotonic() + 3
    while any(map(running, workers)) and time.monotonic() < deadline:
      time.sleep(0.05)
    assert not [pid for pid in workers if running(pid)]
  finally:
    parent.kill()
    for pid in workers:  # Orphans of a failed test.
      if running(pid):
        os.kill(pid, signal.SIGKILL)


def test_malformed_manifests_are_named(tmp_path):
  directory = prepare_texts(tmp_path, random_documents(8))
  path = directory / MANIFEST
  good = json.loads(path.read_text())
  (tmp_path / "outside.tfrecord").write_bytes(b"")
  delete = object()
  cases = [
      (("splits",), delete, "is malformed: 'splits' has no train list"),
      (("splits", "validation"), delete, "is malformed: 'splits' has no validation list"),
      (("tokenizer",), delete, "is malformed: no 'tokenizer' object"),
      (("tokenizer", "eos_id"), delete, "is malformed: 'tokenizer' lacks eos_id"),
      (("token_dtype",), "float32", "is malformed: 'token_dtype' is 'float32', not uint16 or int32"),
      (("splits", "train", 1, "num_tokens"), delete, "is malformed: splits.train[1] lacks num_tokens"),
      (("splits", "validation", 0), "x.tfrecord", "is malformed: no splits.validation[0] object"),
      (("splits", "train", 0, "file"), "../outside.tfrecord",
       "lists shard file '../outside.tfrecord', which is outside its directory"),
      (("splits", "train", 2, "file"), str(tmp_path / "outside.tfrecord"),
       f"lists shard file '{tmp_path}/outside.tfrecord', which is outside its directory"),
  ]
  for keys, value, problem in cases:
    manifest = copy.deepcopy(good)
    *parents, last = keys
    entry = manifest
    for key in parents:
      entry = entry[key]
    if value is delete:
      del entry[last]
    else:
      entry[last] = value
    path.write_text(json.dumps(manifest))
    with pytest.raises(UserError) as error:
      load_manifest(directory)
    assert str(error.value).startswith(f"dataset manifest {path} {problem}"), keys
    assert "\n" not in str(error.value)
  path.write_text("[]")
  with pytest.raises(UserError, match=f"dataset manifest {path} is not a JSON object"):
    load_manifest(directory)


def test_the_stdlib_corpus_is_the_stdlibs_own_modules_sorted(tmp_path, monkeypatch):
  """Not what pip installed in its site-packages (nor dist-packages), at any depth."""
  root = tmp_path / "lib" / "python3"
  for name in ("os.py", "json/__init__.py", "json/decoder.py", "README.txt",
               "site-packages/numpy/core.py", "site-packages/top.py", "dist-packages/apt.py",
               "encodings/site-packages/inner.py"):
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).write_text("x = 1\n")
  monkeypatch.setattr(sources, "stdlib_root", lambda: root)
  assert sources.resolve_files(sources.SourceSpec(kind="stdlib"), str(tmp_path / "out")) == [
      str(root / name) for name in ("json/__init__.py", "json/decoder.py", "os.py")]


def test_a_foreign_non_empty_directory_is_not_written_into(tmp_path):
  """An HF checkpoint's directory given as --output_dir: refused, nothing written; a failed
  prepare (a bad line) leaves a directory the next, fixed command prepares."""
  (tmp_path / "a.txt").write_text("one")
  model = tmp_path / "model"
  model.mkdir()
  (model / "config.json").write_text("{}")
  (model / "tokenizer.json").write_text("{}")
  source = sources.SourceSpec(kind="text", inputs=(str(tmp_path / "a.txt"),))
  with pytest.raises(UserError, match=f"^{model} is not empty and holds no dataset "
                                      f"\\(config.json\\): give --output_dir a new or empty "
                                      f"directory$"):
    dataset_writer.prepare_dataset(dataset_writer.PrepareOptions(
        source=source, output_dir=model, validation_fraction=0.0, num_shards=1))
  assert sorted(p.name for p in model.iterdir()) == ["config.json", "tokenizer.json"]
  kept = tmp_path / "kept"  # Empty but for a dot-file: no content of anyone's.
  kept.mkdir()
  (kept / ".gitkeep").write_text("")
  dataset_writer.prepare_dataset(dataset_writer.PrepareOptions(
      source=source, output_dir=kept, validation_fraction=0.0, num_shards=1))
  (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\nnot json\n')
  failing = dataset_writer.PrepareOptions(
      source=sources.SourceSpec(kind="jsonl", inputs=(str(tmp_path / "bad.jsonl"),)),
      output_dir=tmp_path / "out", validation_fraction=0.0, num_shards=1)
  with pytest.raises(UserError):
    dataset_writer.prepare_dataset(failing)
  dataset_writer.prepare_dataset(dataset_writer.PrepareOptions(
      source=source, output_dir=tmp_path / "out", validation_fraction=0.0, num_shards=1))
  assert read_documents(tmp_path / "out") == ["one"]
