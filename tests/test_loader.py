"""The tf.data loader: exact packing, seeding, per-process shards, mixtures, resume and corruption."""
import json
import pathlib
import shutil

import jax
import numpy as np
import pytest

from conftest import prepare_texts, random_documents, write_dataset
from levanter_flax.data import DataConfig, eval_set, loader, schedule, tfrecord
from levanter_flax.data.manifest import PreparedDataset, load_manifest
from levanter_flax.data.position import DataPosition, ReaderGroups, default_reader_groups
from levanter_flax.core.errors import UserError

SEQ_LEN = 16


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> list[pathlib.Path]:
  root = tmp_path_factory.mktemp("loader")
  return [prepare_texts(root / name, random_documents(40, seed=i))
          for i, name in enumerate(["a", "b"])]


def source(directory, name="train", weight=1.0) -> PreparedDataset:
  return PreparedDataset(name, directory, load_manifest(directory), weight)


def take(sources, count, *, seed=0, start=0, per_source=None, batch=1, **kwargs):
  """The first `count` batches (rows, when batch=1) and their sources, from window `start`."""
  per_source = per_source or ({s.name: start for s in sources} if len(sources) == 1 else {})
  dataset = loader.train_dataset(sources, seq_len=SEQ_LEN, local_batch_size=batch, seed=seed,
                                 position=DataPosition(start, per_source), **kwargs)
  batches = list(dataset.take(count).as_numpy_iterator())
  return (np.stack([b["tokens"] for b in batches]).squeeze(1 if batch == 1 else ()),
          np.concatenate([b["source"] for b in batches]))


def packed_windows(directory, shards) -> list[tuple]:
  """Each shard's documents joined with EOS and cut into SEQ_LEN windows, read with plain TF."""
  manifest = load_manifest(directory)
  windows = []
  for shard in shards:
    documents = tfrecord.read_shard(str(directory / shard["file"]), manifest["token_dtype"])
    stream = np.concatenate([np.append(d, 256) for d in documents])
    usable = len(stream) // SEQ_LEN * SEQ_LEN
    windows += [tuple(w) for w in stream[:usable].reshape(-1, SEQ_LEN)]
  return windows


def epoch_length(directory, process_index=0, process_count=1) -> int:
  shards = load_manifest(directory)["splits"]["train"][process_index::process_count]
  return int(schedule.shard_windows(shards, SEQ_LEN).sum())


def test_an_epoch_is_every_packed_window_exactly_once(datasets):
  directory = datasets[0]
  windows, _ = take([source(directory)], epoch_length(directory))
  expected = packed_windows(directory, load_manifest(directory)["splits"]["train"])
  assert sorted(map(tuple, windows)) == sorted(expected)


def test_same_seed_gives_the_same_batches(datasets):
  first, _ = take([source(datasets[0])], 6, seed=3, batch=4)
  np.testing.assert_array_equal(first, take([source(datasets[0])], 6, seed=3, batch=4)[0])
  assert not np.array_equal(first, take([source(datasets[0])], 6, seed=4, batch=4)[0])


def test_processes_read_disjoint_shards_that_cover_the_dataset(datasets):
  directory = datasets[0]
  per_process = [set(map(tuple, take([source(directory)], epoch_length(directory, i, 2),
                                     groups=ReaderGroups(2, range(i, i + 1)))[0]))
                 for i in range(2)]
  assert not per_process[0] & per_process[1]
  assert per_process[0] | per_process[1] == set(
      packed_windows(directory, load_manifest(directory)["splits"]["train"]))


def test_batches_depend_on_the_reader_groups_not_on_the_processes(datasets):
  sources = [source(datasets[0])]
  one_process, _ = take(sources, 5, batch=4, groups=ReaderGroups(2, range(2)))
  two_processes = [take(sources, 5, batch=2, groups=ReaderGroups(2, range(i, i + 1)))[0]
                   for i in range(2)]
  np.testing.assert_array_equal(one_process, np.concatenate(two_processes, axis=1))
  with pytest.raises(UserError, match=r"config.trainer.batch_size \(6\) must be a multiple of "
                                      r"the run's 4 reader groups \(config.data.reader_groups, "
                                      r"fixed when the run first started: its batches depend on "
                                      r"it\), e.g. 4 or 8$"):
    take(sources, 1, batch=3, groups=ReaderGroups(4, range(2)))
  with pytest.raises(UserError, match=r"this run's 2 processes cannot share its 3 reader groups "
                                      r"\(config.data.reader_groups, fixed when the run first "
                                      r"started\): run it on a number of processes that divides 3"):
    ReaderGroups.of_process(3, 0, 2)


@pytest.mark.parametrize("batch, processes, shards, filled, expected", [
    (8, 1, 8, 8, 8), (32, 2, 16, 16, 8), (12, 1, 8, 8, 6), (16, 1, 3, 3, 2), (32, 16, 64, 64, 16),
    (36, 6, 8, 8, 6), (2, 2, 1, 1, 2), (8, 1, 8, 2, 2), (8, 1, 8, 1, 1)])
def test_the_default_reader_groups_divide_the_batch_and_give_each_group_windows(
    batch, processes, shards, filled, expected):
  """`filled` of the shards hold a window of 16 tokens; the rest are (nearly) empty."""
  entries = [{"num_tokens": 40 if i < filled else 3, "num_documents": 1} for i in range(shards)]
  sources = [PreparedDataset("a", pathlib.Path("a"), {"splits": {"train": entries}}, 1.0)]
  assert default_reader_groups(batch, processes, sources, 16) == expected


def test_resume_at_any_position_continues_the_same_stream(datasets):
  directory = datasets[0]
  epoch = epoch_length(directory)
  reference, _ = take([source(directory)], 2 * epoch + 12)
  for start in (1, 17, epoch - 1, epoch, epoch + 5, 2 * epoch + 3):
    resumed, _ = take([source(directory)], 8, start=start)
    np.testing.assert_array_equal(resumed, reference[start:start + 8], err_msg=str(start))


def test_resume_position_is_arithmetic_not_replay(datasets):
  """Where window n lives is computed from the manifest, so step 10**12 costs what step 1 does."""
  order = schedule.ShardOrder(np.array([5, 0, 3, 9]), seed=(0, 0))

  def windows_from(start, num_epochs):
    """(shard, window) in stream order, as the chunks of `num_epochs` epochs from `start` say."""
    for epoch in range(num_epochs):
      for shard, _, skip in zip(*order.epoch_chunks(start, epoch)):
        yield from ((int(shard), w) for w in range(skip, order.windows[shard]))
  timeline = list(windows_from(0, 6))
  assert len(timeline) == 6 * 17
  for start in range(0, 5 * 17):
    assert list(windows_from(start, 2))[:17] == timeline[start:start + 17], start
  far, _ = take([source(datasets[0])], 2, start=10**12, batch=4)
  assert far.shape == (2, 4, SEQ_LEN)


def test_mixture_draws_each_source_at_its_weight_and_resumes(datasets):
  sources = [source(datasets[0], "a", 3.0), source(datasets[1], "b", 1.0)]
  windows, ids = take(sources, 2000)
  assert abs(np.mean(ids == 0) - 0.75) < 0.01
  for k, directory in enumerate(datasets):
    own = set(packed_windows(directory, load_manifest(directory)["splits"]["train"]))
    assert all(tuple(w) in own for w in windows[ids == k])
  mixture = schedule.Mixture(["a", "b"], [3.0, 1.0], seed=0)
  np.testing.assert_array_equal(mixture.consumed(777), np.bincount(ids[:777], minlength=2))
  counts = mixture.consumed(777)
  resumed, resumed_ids = take(sources, 8, start=777, per_source={"a": counts[0], "b": counts[1]})
  np.testing.assert_array_equal(resumed, windows[777:785])
  np.testing.assert_array_equal(resumed_ids, ids[777:785])


def damaged_copy(directory: pathlib.Path, destination: pathlib.Path, damage,
                 shard_index: int = 1) -> tuple[pathlib.Path, dict]:
  """A copy of the dataset with one train shard hurt by damage(path); returns that shard's entry."""
  shutil.copytree(directory, destination)
  entry = load_manifest(destination)["splits"]["train"][shard_index]
  damage(destination / entry["file"])
  return destination, entry


def flip_a_byte(path: pathlib.Path) -> None:
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0xFF
  path.write_bytes(bytes(data))


def cut_in_half(path: pathlib.Path) -> None:
  path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


def keep_a_few_bytes(path: pathlib.Path) -> None:
  """What is left is less than a window: the shard can yield no window at all."""
  path.write_bytes(path.read_bytes()[:SEQ_LEN + 16])


def train_batches(directory, on_corrupt_record, vocab_size=257):
  cfg = DataConfig(dataset=str(directory), mixture=(), tokenizer="byte", cache_dir="",
                   validation_fraction=0.02, num_train_shards=4, on_corrupt_record=on_corrupt_record)
  sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(jax.devices()[:1], ("data",)),
                                        jax.sharding.PartitionSpec("data"))
  return loader.TrainBatches([source(directory)], cfg, seq_len=SEQ_LEN, local_batch_size=4,
                             seed=0, position=DataPosition(0, {"train": 0}),
                             sharding=sharding, vocab_size=vocab_size)


@pytest.mark.parametrize("damage", [flip_a_byte, cut_in_half, keep_a_few_bytes])
def test_a_damaged_shard_stops_the_run_naming_it_or_is_left_out_and_counted(datasets, tmp_path,
                                                                            damage):
  directory, entry = damaged_copy(datasets[0], tmp_path / "damaged", damage)
  batches_per_epoch = epoch_length(directory) // 4
  with pytest.raises(UserError, match=f"damaged train shard {directory / entry['file']}: it "
                     f"decodes to \\d+ records and \\d+ tokens \\(EOS included\\), but its "
                     f"manifest lists {entry['num_documents']} and "
                     f"{entry['num_tokens'] + entry['num_documents']}; set "
                     f"config.data.on_corrupt_record='skip'"):
    failing = train_batches(directory, "fail")
    for _ in range(batches_per_epoch + 1):
      next(failing)
  skipping = train_batches(directory, "skip")
  damaged_windows = schedule.shard_windows([entry], SEQ_LEN)[0]
  batches = [next(skipping) for _ in range((epoch_length(directory) - damaged_windows) // 4)]
  assert skipping.corrupt_records_skipped == entry["num_documents"]
  assert batches[-1][1].windows == 4 * len(batches)
  intact = set(packed_windows(directory, [s for s in load_manifest(directory)["splits"][
      "train"] if s != entry]))
  assert all(tuple(w) in intact for batch, _ in batches for w in np.asarray(batch["tokens"]))


def test_a_source_whose_every_shard_is_damaged_ends_the_run(datasets, tmp_path):
  directory = tmp_path / "damaged"
  shutil.copytree(datasets[0], directory)
  for entry in load_manifest(directory)["splits"]["train"]:
    keep_a_few_bytes(directory / entry["file"])
  skipping = train_batches(directory, "skip")
  with pytest.raises(UserError, match=f"every train shard of {directory} that reader group 0 "
                                      f"reads is damaged: nothing is left to train on"):
    next(skipping)


def read_an_epoch(directory: pathlib.Path) -> None:
  """Every train shard at least once, stopping at the first damaged one (on_corrupt_record)."""
  batches = train_batches(directory, "fail")
  for _ in range(epoch_length(directory) // 4 + 1):
    next(batches)


def rewrite(path: pathlib.Path, dtype: str = "uint16", change=lambda tokens: tokens) -> None:
  """The shard's uint16 documents written again, each `change`d, as `dtype` tokens."""
  documents = list(tfrecord.read_shard(str(path), "uint16"))
  path.unlink()
  with tfrecord.ShardWriter(path, dtype) as writer:
    for document in documents:
      writer.write(change(document))


def rewrite_as_int32(path: pathlib.Path) -> None:
  """The same documents with 4-byte tokens, under a manifest that says uint16."""
  rewrite(path, "int32")


def test_shards_of_another_token_dtype_are_refused(datasets, tmp_path):
  directory, entry = damaged_copy(datasets[0], tmp_path / "int32", rewrite_as_int32, 0)
  with pytest.raises(UserError, match=f"damaged train shard {directory / entry['file']}: .*; were "
                                      f"its tokens written with another dtype than the "
                                      f"manifest's uint16"):
    read_an_epoch(directory)


def reverse_each_document(path: pathlib.Path) -> None:
  """Other tokens, the same counts: what a shard of another dataset looks like to them."""
  rewrite(path, change=lambda tokens: tokens[::-1])


def test_a_shard_of_other_data_with_the_same_counts_is_refused(datasets, tmp_path):
  directory, entry = damaged_copy(datasets[0], tmp_path / "other", reverse_each_document)
  with pytest.raises(UserError, match=f"train shard {directory / entry['file']} is not the one "
                                      f"its manifest lists: its tokens' CRC32C is \\d+, the "
                                      f"manifest's {entry['tokens_crc32c']}"):
    read_an_epoch(directory)
  validation = load_manifest(directory)["splits"]["validation"][0]
  reverse_each_document(directory / validation["file"])
  with pytest.raises(UserError, match=f"validation shard {directory / validation['file']} is not "
                                      f"the one its manifest lists"):
    eval_set.build(source(directory), seq_len=SEQ_LEN, eval_tokens="all", vocab_size=257,
                   process_index=0, process_count=1)


def test_a_manifest_from_before_checksums_still_reads(datasets, tmp_path):
  directory = tmp_path / "old"
  shutil.copytree(datasets[0], directory)
  manifest = json.loads((directory / "manifest.json").read_text())
  for split in manifest["splits"].values():
    for entry in split:
      del entry["tokens_crc32c"]
  (directory / "manifest.json").write_text(json.dumps(manifest))
  next(train_batches(directory, "fail"))
  eval_set.build(source(directory), seq_len=SEQ_LEN, eval_tokens="all", vocab_size=257,
                 process_index=0, process_count=1)


def with_a_bad_record(record: bytes):
  """A damage: the shard's last document replaced by `record`."""
  def damage(path: pathlib.Path) -> None:
    documents = list(tfrecord.read_shard(str(path), "uint16"))[:-1]
    path.unlink()
    with tfrecord.ShardWriter(path, "uint16") as writer:
      for document in documents:
        writer.write(document)
      writer._writer.write(record)  # pylint: disable=protected-access
  return damage


NOT_AN_EXAMPLE = b"\x00not a tf.train.Example"
# An Example whose token bytes are odd in number: no whole uint16 tokens.
HALF_A_TOKEN = tfrecord._example(b"\x01")  # pylint: disable=protected-access


@pytest.mark.parametrize("record", [NOT_AN_EXAMPLE, HALF_A_TOKEN], ids=["not_an_example",
                                                                         "half_a_token"])
def test_a_record_that_does_not_decode_is_damage_not_a_crash(datasets, tmp_path, record):
  """Records are decoded a batch at a time: one bad record must still read as a damaged shard."""
  directory, entry = damaged_copy(datasets[0], tmp_path / "bad_record", with_a_bad_record(record))
  with pytest.raises(UserError, match=f"damaged train shard {directory / entry['file']}: it "
                                      f"decodes to \\d+ records"):
    read_an_epoch(directory)


def test_token_ids_outside_the_vocabulary_are_named(datasets):
  with pytest.raises(UserError, match=f"token id \\d+ in {datasets[0]} is outside "
                                      f"config.model.vocab_size \\(200\\)"):
    next(train_batches(datasets[0], "fail", vocab_size=200))


def test_a_dataset_with_fewer_filled_shards_than_reader_groups_says_so(tmp_path):
  """3 documents in 8 shards: the default groups fit them; 8 groups explicitly are refused, naming
  the data's shards and the setting rather than a group number the user never chose."""
  directory = write_dataset(tmp_path / "data", random_documents(3), random_documents(3, 1), 8)
  sources = [source(directory)]
  assert default_reader_groups(8, 1, sources, SEQ_LEN) == 2  # Shards 0, 2, 5 hold them.
  with pytest.raises(UserError, match=rf"^dataset {directory} is too small for the run's 8 reader "
                                      rf"groups \(config.data.reader_groups\): 3 of its 8 train "
                                      rf"shards hold a whole 16-token window \(3 documents in "
                                      rf"all\), and some groups read none of those; prepare it "
                                      rf"with fewer shards \(--num_shards=3\)"):
    take(sources, 1, batch=8, groups=ReaderGroups(8, range(8)))


def test_the_whole_eval_set_is_the_validation_stream_cut_into_windows(datasets):
  validation = source(datasets[0])
  manifest = validation.manifest
  stream = np.concatenate([np.append(doc, 256) for f in validation.files("validation")
                           for doc in tfrecord.read_shard(f, manifest["token_dtype"])])
  windows = stream[:len(stream) // SEQ_LEN * SEQ_LEN].reshape(-1, SEQ_LEN)
  shares = [eval_set.build(validation, seq_len=SEQ_LEN, eval_tokens="all", vocab_size=257,
                           process_index=i, process_count=2).windows for i in range(2)]
  np.testing.assert_array_equal(np.concatenate(shares), windows)
  assert validation.validation_tokens_per_byte == pytest.approx(
      len(stream) / sum(s["num_text_bytes"] for s in manifest["splits"]["validation"]))


def test_the_train_stream_has_no_python_generator_dataset(datasets):
  """Building a from_generator dataset makes TF pin glibc's mmap threshold at 128 KiB for the
  whole process; XLA:CPU then maps fresh scratch pages in every op (a third of a nano step)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  dataset = loader.train_dataset([source(datasets[0], "a"), source(datasets[1], "b")],
                                 seq_len=SEQ_LEN, local_batch_size=2, seed=0,
                                 position=DataPosition(0, {}))
  graph = tf.compat.v1.GraphDef.FromString(dataset._as_serialized_graph(  # pylint: disable=protected-access
      external_state_policy=tf.data.experimental.ExternalStatePolicy.WARN).numpy())
  ops = {n.op for n in graph.node} | {n.op for f in graph.library.function for n in f.node_def}
  assert "EagerPyFunc" in ops and "GeneratorDataset" not in ops


def test_the_train_pipeline_runs_without_autotuning(datasets):
  """tf.data's autotuning thread held each iterator's teardown for up to its optimization period,
  which backs off to a minute: 2,000-step runs exited 5-25 s after their last step (seen in a
  native stack: ~RootDataset::Iterator waiting on its thread)."""
  train = loader.train_dataset([source(datasets[0])], seq_len=SEQ_LEN, local_batch_size=2, seed=0,
                               position=DataPosition(0, {"train": 0}))
  assert train.options().autotune.enabled is False
