"""The prepare step: every source round-trips exactly, restarts keep finished shards, bad input is named."""
import gzip
import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, prepare_texts, random_documents
from levanter_flax.data import prepare, sources, tfrecord
from levanter_flax.data.tokenizers import load_tokenizer
from levanter_flax.errors import UserError


def read_documents(directory, split=None) -> list[str]:
  """Every document of a prepared dataset, decoded back to text."""
  manifest = prepare.load_manifest(directory)
  tokenizer = load_tokenizer("byte")
  splits = [split] if split else list(manifest["splits"])
  return [tokenizer.decode(tokens) for s in splits for shard in manifest["splits"][s]
          for tokens in tfrecord.read_shard(str(directory / shard["file"]), manifest["token_dtype"])]


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
  manifest = prepare.load_manifest(directory)
  assert sorted(read_documents(directory)) == sorted(texts[:-1])
  validation = read_documents(directory, "validation")
  assert 0 < len(validation) < 15
  assert all(prepare.is_validation(f"{texts.index(t):04d}.txt", 0.2) for t in validation)
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
  prepare.prepare_dataset(prepare.PrepareOptions(source=spec, **options))
  assert sorted(read_documents(tmp_path / "text")) == ["first doc", "second doc", "third"]

  records = [{"text": t, "id": i} for i, t in enumerate(random_documents(12))]
  with gzip.open(tmp_path / "a.jsonl.gz", "wt", encoding="utf-8") as f:
    f.write("\n".join(json.dumps(r) for r in records) + "\n\n")
  spec = sources.SourceSpec(kind="jsonl", inputs=(str(tmp_path / "*.jsonl.gz"),))
  prepare.prepare_dataset(prepare.PrepareOptions(source=spec, **options | {
      "output_dir": tmp_path / "jsonl"}))
  assert sorted(read_documents(tmp_path / "jsonl")) == sorted(r["text"] for r in records)


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
  prepare.prepare_dataset(prepare.PrepareOptions(source=spec, output_dir=tmp_path / "out",
                                                 validation_fraction=0.0, num_shards=3))
  assert sorted(read_documents(tmp_path / "out")) == sorted(texts)
  with pytest.raises(UserError, match="TFDS dataset 'tiny_text' has no feature 'text'"):
    prepare.prepare_dataset(prepare.PrepareOptions(
        source=sources.SourceSpec(kind="tfds", inputs=("tiny_text",),
                                  tfds_data_dir=str(tmp_path / "tfds")),
        output_dir=tmp_path / "out2"))


def test_parallel_workers_write_the_same_shards(tmp_path):
  texts = random_documents(20)
  one = prepare_texts(tmp_path / "one", texts)
  two = prepare_texts(tmp_path / "two", texts, num_workers=2)
  for shard in prepare.load_manifest(one)["splits"]["train"]:
    assert (one / shard["file"]).read_bytes() == (two / shard["file"]).read_bytes()


def test_restart_keeps_finished_shards_and_redoes_the_rest(tmp_path):
  texts = random_documents(20)
  directory = prepare_texts(tmp_path, texts)
  before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in directory.glob("*.tfrecord")}
  # A run killed while writing shard 2: no manifest, no done-marker, a temp file left over.
  (directory / prepare.MANIFEST).unlink()
  (directory / "shard-00002-of-00004.done.json").unlink()
  (directory / "train-00002-of-00004.tfrecord").unlink()
  (directory / "train-00002-of-00004.tfrecord.tmp-999").write_bytes(b"partial")
  prepare_texts(tmp_path, texts)
  after = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in directory.glob("*.tfrecord")}
  assert after.keys() == before.keys()
  assert not list(directory.glob("*.tmp-*"))
  for name in before:
    assert after[name][1] == before[name][1], name
    assert (after[name][0] == before[name][0]) == ("00002" not in name), name
  assert sorted(read_documents(directory)) == sorted(texts)
  with pytest.raises(UserError, match="prepared with different arguments \\(num_shards\\)"):
    prepare_texts(tmp_path, texts, num_shards=5)
  with pytest.raises(UserError, match="prepared with different arguments \\(input_files\\)"):
    prepare_texts(tmp_path, texts + ["one more"])


def test_non_utf8_is_replaced_and_counted_or_refused(tmp_path):
  (tmp_path / "input").mkdir()
  (tmp_path / "input" / "bad.txt").write_bytes(b"caf\xe9 au lait")
  (tmp_path / "input" / "good.txt").write_text("plain")
  spec = sources.SourceSpec(kind="text", inputs=(str(tmp_path / "input" / "*.txt"),))
  directory = prepare.prepare_dataset(prepare.PrepareOptions(
      source=spec, output_dir=tmp_path / "out", validation_fraction=0.0))
  assert sorted(read_documents(directory)) == ["caf\ufffd au lait", "plain"]
  assert prepare.load_manifest(directory)["source"]["invalid_utf8_documents"] == 1
  strict = sources.SourceSpec(kind="text", inputs=spec.inputs, on_decode_error="error")
  with pytest.raises(UserError, match=r"bad.txt: invalid UTF-8 at byte 3"):
    prepare.prepare_dataset(prepare.PrepareOptions(source=strict, output_dir=tmp_path / "out2"))


def _jsonl_error(tmp_path, lines: list[str]) -> str:
  tmp_path = tmp_path / str(len(list(tmp_path.iterdir())))
  tmp_path.mkdir()
  (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
  source = sources.SourceSpec(kind="jsonl", inputs=(str(tmp_path / "a.jsonl"),))
  with pytest.raises(UserError) as error:
    prepare.prepare_dataset(prepare.PrepareOptions(source=source, output_dir=tmp_path / "out",
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
    prepare.prepare_dataset(prepare.PrepareOptions(
        source=sources.SourceSpec(kind="text", inputs=("/nowhere/*.txt",)),
        output_dir=tmp_path / "out2"))


def run_prepare(*args):
  return subprocess.run([sys.executable, "-m", "levanter_flax.prepare", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=300)


def test_command_line_trains_a_tokenizer_and_names_bad_input(tmp_path):
  (tmp_path / "in").mkdir()
  for i, text in enumerate(random_documents(30)):
    (tmp_path / "in" / f"{i}.txt").write_text(text)
  result = run_prepare("--source=text", f"--input={tmp_path}/in/*.txt", "--train_tokenizer",
                       "--vocab_size=300", f"--output_dir={tmp_path}/out", "--num_shards=2",
                       "--validation_fraction=0.2")
  assert result.returncode == 0, result.stderr[-3000:]
  manifest = prepare.load_manifest(tmp_path / "out")
  assert manifest["tokenizer"]["kind"] == "huggingface"
  assert manifest["tokenizer"]["vocab_size"] == 300
  assert manifest["token_dtype"] == "uint16"

  result = run_prepare("--source=jsonl", "--input=/nowhere/*.jsonl", f"--output_dir={tmp_path}/x")
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1] == (
      "levanter_flax: error: input glob '/nowhere/*.jsonl' matches no files")
  assert "Traceback" not in result.stderr
