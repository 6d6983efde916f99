"""TFRecord round trip, the prepared corpus, and the tf.data loader's packing and seeding."""
import numpy as np
import pytest

from levanter_flax.config import default_config, to_run_config
from levanter_flax.data import corpus, prepare, tfrecord
from levanter_flax.data.loader import eval_dataset, train_dataset
from levanter_flax.data.tokenizers import ByteTokenizer
from levanter_flax.errors import UserError


@pytest.mark.parametrize("vocab_size", [257, 50257, 128_256])
def test_tfrecord_round_trip_is_exact(tmp_path, vocab_size):
  rng = np.random.default_rng(0)
  documents = [rng.integers(0, vocab_size, size=n) for n in (1, 7, 1000, 0, 65)]
  documents[2][:2] = [0, vocab_size - 1]  # Both ends of the id range.
  dtype = tfrecord.token_dtype(vocab_size)
  path = str(tmp_path / "shard.tfrecord")
  assert tfrecord.write_shard(path, documents, dtype) == (5, 1073)
  read = list(tfrecord.read_shard(path, dtype))
  assert len(read) == len(documents)
  for got, want in zip(read, documents):
    np.testing.assert_array_equal(got, want)
  assert not list(tmp_path.glob("*.tmp-*"))


def test_byte_tokenizer_round_trip():
  tokenizer = ByteTokenizer()
  text = "def f(x):\n    return 'héllo ✓'\n"
  assert tokenizer.decode(tokenizer.encode(text)) == text


def _data_config(cache_dir):
  config = default_config()
  config.data.cache_dir = str(cache_dir)
  return to_run_config(config).data


def test_prepared_corpus_holds_every_token(data_cache):
  directory = prepare.dataset_dir(_data_config(data_cache))
  manifest = prepare.load_manifest(directory)
  tokenizer = ByteTokenizer()
  expected = {"train": [0, 0], "validation": [0, 0]}
  empty = 0
  for name, text in corpus.stdlib_documents():
    if not text:
      empty += 1
      continue
    split = "validation" if prepare.is_validation(name, 0.02) else "train"
    expected[split][0] += 1
    expected[split][1] += len(tokenizer.encode(text))
  for split, (documents, tokens) in expected.items():
    shards = manifest["splits"][split]
    assert sum(s["num_documents"] for s in shards) == documents
    assert sum(s["num_tokens"] for s in shards) == tokens
  assert manifest["sources"][0]["empty_documents_skipped"] == empty
  assert manifest["tokenizer"] == {"name": "byte", "vocab_size": 257, "eos_id": 256}


def test_eval_windows_are_the_validation_stream_in_order(data_cache):
  directory = prepare.dataset_dir(_data_config(data_cache))
  manifest = prepare.load_manifest(directory)
  shard = manifest["splits"]["validation"][0]["file"]
  stream = np.concatenate([np.append(doc, 256) for doc in
                           tfrecord.read_shard(str(directory / shard), manifest["token_dtype"])])
  batches = list(eval_dataset(directory, manifest, seq_len=100, local_batch_size=4,
                              num_batches=3).as_numpy_iterator())
  windows = np.concatenate([b["tokens"] for b in batches]).reshape(-1)
  np.testing.assert_array_equal(windows, stream[:len(windows)])


def _first_batches(directory, manifest, n, **kwargs):
  it = train_dataset(directory, manifest, seq_len=32, local_batch_size=4,
                     shuffle_buffer_size=64, **kwargs).as_numpy_iterator()
  return np.stack([next(it)["tokens"] for _ in range(n)])


def test_train_stream_is_seeded_and_resumable(data_cache):
  directory = prepare.dataset_dir(_data_config(data_cache))
  manifest = prepare.load_manifest(directory)
  first = _first_batches(directory, manifest, 6, seed=3)
  np.testing.assert_array_equal(first, _first_batches(directory, manifest, 6, seed=3))
  assert not np.array_equal(first, _first_batches(directory, manifest, 6, seed=4))
  np.testing.assert_array_equal(first[4:], _first_batches(directory, manifest, 2, seed=3, start_batch=4))


def test_processes_read_disjoint_documents(data_cache):
  directory = prepare.dataset_dir(_data_config(data_cache))
  manifest = prepare.load_manifest(directory)
  per_process = [eval_dataset(directory, manifest, seq_len=64, local_batch_size=2, num_batches=1,
                              process_index=i, process_count=2) for i in range(2)]
  a, b = (next(ds.as_numpy_iterator())["tokens"] for ds in per_process)
  assert not np.array_equal(a, b)


def test_unwritable_cache_dir_is_named(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  with pytest.raises(UserError, match=f"cannot create dataset directory {blocker}/"):
    prepare.prepare(_data_config(blocker))
