"""prepare on Apache Beam: the local engine's bytes, two worker processes, restarts, one-line errors."""
import dataclasses
import gzip
import json
import os
import pathlib
import signal
import sys
import threading

import pytest
import zstandard
from etils import epath

import forkserver
from conftest import REPO, parent_pid, random_documents
from levanter_flax.data import beam_engine, dataset_writer, sources
from levanter_flax.data.manifest import MANIFEST, load_manifest
from levanter_flax.core.errors import UserError


def mixed_jsonl(directory: pathlib.Path) -> sources.SourceSpec:
  """JSON lines plain, .gz and .zst, with an empty document and one of invalid UTF-8."""
  directory.mkdir()
  texts = random_documents(30)
  lines = [json.dumps({"text": t}).encode() for t in texts] + [b'{"text": ""}',
                                                                  b'{"text": "bad \xff byte"}']
  (directory / "a.jsonl").write_bytes(b"\n".join(lines[:12]))
  (directory / "b.jsonl.gz").write_bytes(gzip.compress(b"\n".join(lines[12:22])))
  (directory / "c.jsonl.zst").write_bytes(zstandard.compress(b"\n".join(lines[22:])))
  return sources.SourceSpec(kind="jsonl", inputs=(str(directory / "*.jsonl*"),))


def parquet_with_nulls(directory: pathlib.Path) -> sources.SourceSpec:
  import pyarrow
  from pyarrow import parquet
  directory.mkdir()
  column = random_documents(40, seed=1)
  column[5] = None
  parquet.write_table(pyarrow.table({"text": column[:30]}), directory / "a.parquet",
                      row_group_size=7)
  parquet.write_table(pyarrow.table({"text": column[30:]}), directory / "b.parquet")
  return sources.SourceSpec(kind="parquet", inputs=(str(directory / "*.parquet"),))


def prepare_with(engine: str, source: sources.SourceSpec, output_dir: pathlib.Path,
                 **options) -> pathlib.Path:
  return dataset_writer.prepare_dataset(dataset_writer.PrepareOptions(
      source=source, output_dir=output_dir, engine=engine,
      **{"num_shards": 3, "validation_fraction": 0.2, **options}))


WORKER_MODULE = b"apache_beam.runners.worker.sdk_worker_main"


def beam_workers() -> list[int]:
  """This process's Beam worker processes (python -m ...sdk_worker_main), not those of
  another test running alongside (pytest -n)."""
  workers = []
  for child in pathlib.Path("/proc").glob("[0-9]*"):
    try:
      if WORKER_MODULE not in (child / "cmdline").read_bytes().split(b"\0"):
        continue
      pid = int(child.name)
      while pid > 1 and pid != os.getpid():
        pid = parent_pid(pid)
      if pid == os.getpid():
        workers.append(int(child.name))
    except (OSError, ValueError, IndexError):  # Gone meanwhile.
      pass
  return workers


def worker_processes_while(run) -> int:
  """How many Beam worker processes of this process ran at once, at most, while `run()` ran."""
  most, done = [0], threading.Event()
  def watch():
    while not done.wait(0.05):
      most[0] = max(most[0], len(beam_workers()))
  watcher = threading.Thread(target=watch)
  watcher.start()
  try:
    run()
  finally:
    done.set()
    watcher.join()
  return most[0]


def contents(directory: pathlib.Path) -> dict[str, bytes]:
  """Every file but the lock (who held it, and since when)."""
  return {p.name: p.read_bytes() for p in directory.iterdir() if p.name != ".lock"}


def assert_same_files(one: pathlib.Path, two: pathlib.Path) -> None:
  one, two = contents(one), contents(two)
  assert sorted(one) == sorted(two)
  for name in one:
    assert one[name] == two[name], name


@pytest.mark.slow
@pytest.mark.parametrize("make_source, options", [
    (mixed_jsonl, {}),
    (parquet_with_nulls, {"train_tokenizer_vocab_size": 300, "tokenizer_sample_bytes": 4000}),
])
def test_beam_with_two_workers_writes_the_local_engines_bytes(tmp_path, make_source, options):
  source = make_source(tmp_path / "input")
  local = prepare_with("local", source, tmp_path / "local", **options)
  workers = worker_processes_while(
      lambda: prepare_with("beam", source, tmp_path / "beam", num_workers=2, **options))
  assert workers >= 2  # Beam may start a replacement before the worker it replaces is gone.
  assert_same_files(local, tmp_path / "beam")
  manifest = load_manifest(local)
  if options:  # The tokenizer saw about 4000 bytes: 1334 from each of the 3 parts.
    sample = manifest["tokenizer_training"]
    assert 4000 <= sample["text_bytes"] < 4000 + 3 * 400 and sample["documents"] < 20
  else:
    assert (manifest["source"]["empty_documents_skipped"],
            manifest["source"]["invalid_utf8_documents"]) == (1, 1)


def test_a_rerun_beam_job_keeps_finished_shards(tmp_path):
  source = mixed_jsonl(tmp_path / "input")
  directory = prepare_with("beam", source, tmp_path / "data")
  complete = contents(directory)
  kept = {p.name: p.stat().st_mtime_ns for p in directory.glob("*-00000-of-00003.tfrecord")}
  # A job that died while writing shard 1: its files and the manifest are missing.
  for name in (MANIFEST, "shard-00001-of-00003.done.json", "train-00001-of-00003.tfrecord"):
    (directory / name).unlink()
  (directory / "validation-00001-of-00003.tfrecord.tmp-99").write_bytes(b"partial")
  with pytest.raises(UserError, match="not a prepared dataset"):
    load_manifest(directory)
  prepare_with("beam", source, directory)
  assert contents(directory) == complete
  assert kept == {p.name: p.stat().st_mtime_ns
                  for p in directory.glob("*-00000-of-00003.tfrecord")}


def test_bad_pipeline_options_and_paths_remote_workers_cannot_see_are_named(tmp_path):
  source = mixed_jsonl(tmp_path / "input")
  for flags, message in [
      (("--runer=DataflowRunner",), "unknown Beam option(s) --runer"),
      (("--direct_num_workers=many",), "argument --direct_num_workers: invalid int value"),
      (("--runner=NoSuchRunner",), "runner 'NoSuchRunner': Unexpected pipeline runner"),
      (("--runner=DataflowRunner", "--project=p", "--region=r", "--temp_location=gs://b/t"),
       f"--output_dir={tmp_path / 'out'} is on this machine, which DataflowRunner's workers "
       f"cannot see: use gs://"),
  ]:
    with pytest.raises(UserError) as error:
      prepare_with("beam", source, tmp_path / "out", beam_pipeline_options=flags)
    assert message in str(error.value)
  assert not (tmp_path / "out").exists()
  # Beam's short names for local runners are local too: no gs:// needed.
  direct = dataset_writer.PrepareOptions(source=source, output_dir=tmp_path / "out", engine="beam",
                                         beam_pipeline_options=("--runner=direct",))
  assert beam_engine.is_local(beam_engine.pipeline(direct, num_files=3).runner)
  on_gcs = dataset_writer.PrepareOptions(
      source=sources.SourceSpec(kind="jsonl", inputs=("gs://b/in/*.jsonl",)),
      output_dir=epath.Path("gs://b/out"), engine="beam",
      beam_pipeline_options=("--runner=DataflowRunner",))
  with pytest.raises(UserError, match="runner 'DataflowRunner': Pipeline has validations errors: "
                                      "Missing GCS path option: temp_location. Missing"):
    beam_engine.pipeline(on_gcs, num_files=8)
  with pytest.raises(UserError, match="3 input files for --num_shards=8: with fewer files than "
                                      "shards every DataflowRunner worker reads every file"):
    beam_engine.pipeline(dataclasses.replace(on_gcs, beam_pipeline_options=(
        "--runner=DataflowRunner", "--project=p", "--region=r", "--temp_location=gs://b/t")),
                         num_files=3)


def test_without_beam_installed_the_engine_says_what_to_install(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "apache_beam", None)  # What `import` finds missing.
  with pytest.raises(UserError, match=r'--engine=beam needs Apache Beam: pip install '
                                      r'"levanter_flax\[beam\]"'):
    prepare_with("beam", mixed_jsonl(tmp_path / "input"), tmp_path / "out")


@pytest.mark.slow
def test_a_corrupt_file_read_by_a_beam_worker_is_one_line(tmp_path):
  source = mixed_jsonl(tmp_path / "input")
  (tmp_path / "input" / "d.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd garbage")
  result = forkserver.run(
      [sys.executable, "-m", "levanter_flax.commands.prepare", "--source=jsonl",
       f"--input={source.inputs[0]}", f"--output_dir={tmp_path / 'out'}", "--engine=beam",
       "--num_workers=2", "--num_shards=4"], cwd=REPO, capture_output=True, text=True, timeout=300)
  assert result.returncode == 1
  assert "Traceback" not in result.stderr, result.stderr[-3000:]
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith(f"levanter_flax: error: cannot read input file "
                         f"{tmp_path / 'input' / 'd.jsonl.zst'}: "), last
  assert not (tmp_path / "out" / MANIFEST).exists()


@pytest.mark.slow
def test_a_killed_beam_worker_is_one_line_and_the_rerun_finishes(tmp_path):
  source = mixed_jsonl(tmp_path / "input")
  killed = []
  def kill_the_first_worker():
    while not killed:
      for pid in beam_workers()[:1]:
        try:
          os.kill(pid, signal.SIGKILL)
          killed.append(pid)
        except OSError:
          pass
  killer = threading.Thread(target=kill_the_first_worker, daemon=True)
  killer.start()
  with pytest.raises(UserError, match="a Beam worker process died \\(killed, or out of memory\\?\\) "
                                      "while writing .*: run the same command again"):
    prepare_with("beam", source, tmp_path / "beam", num_workers=2)
  assert killed and not (tmp_path / "beam" / MANIFEST).exists()
  prepare_with("beam", source, tmp_path / "beam", num_workers=2)
  assert_same_files(prepare_with("local", source, tmp_path / "local"), tmp_path / "beam")
