"""gs:// paths behave as local ones, end to end, against a local Cloud Storage (gcs_emulator)."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import forkserver
from conftest import REPO, random_documents
from gcs_emulator import LocalGCS
from test_main import NANO, TINY, assert_one_line_error

DENIED = "denied-bucket"
TRAIN = [f"--config={NANO}", *TINY, "--config.trainer.batch_size=8",
         "--config.trainer.num_train_steps=6", "--config.trainer.eval_every_steps=3",
         "--config.checkpoint.every_steps=2", "--config.data.reader_groups=2"]


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
  """The emulator and its proxy, with bucket `bkt`; the environment points every client at it."""
  gcs = LocalGCS(str(tmp_path_factory.mktemp("gcs")))
  gcs.create_bucket("bkt")
  gcs.create_bucket(DENIED)
  gcs.deny(DENIED)
  saved = dict(os.environ)
  os.environ.update(gcs.environment())
  try:
    yield gcs
  finally:
    os.environ.clear()
    os.environ.update(saved)
    gcs.stop()


def blobs(prefix: str) -> dict[str, bytes]:
  """name (below prefix) -> contents of every object under gs://bkt/<prefix>; an object deleted
  between the listing and its read (a lock's renewer releasing it) is absent."""
  from google.api_core import exceptions
  from google.cloud import storage
  contents = {}
  for blob in storage.Client().bucket("bkt").list_blobs(prefix=prefix):
    if blob.name.endswith("/"):
      continue
    try:
      contents[blob.name[len(prefix):]] = blob.download_as_bytes()
    except exceptions.NotFound:
      pass
  return contents


def upload(name: str, data: bytes) -> None:
  from google.cloud import storage
  storage.Client().bucket("bkt").blob(name).upload_from_string(data)


def run(module: str, *args, timeout=300) -> subprocess.CompletedProcess:
  return forkserver.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True,
                        text=True, timeout=timeout)


# The prepare command line, stopped for good after its first finished shard.
_PREPARE_ONE_SHARD = """
import os, signal, sys
from absl import app
from levanter_flax.commands import prepare as command
from levanter_flax.core import cli
from levanter_flax.data import shards
write = shards._write_shard
def write_then_die(*args):
  write(*args)
  os.kill(os.getpid(), signal.SIGKILL)
shards._write_shard = write_then_die
app.run(command.main, flags_parser=cli.parse_flags)
"""


@pytest.fixture(scope="module")
def gcs_dataset(gcs, tmp_path_factory):
  """A text corpus prepared from gs:// into gs://bkt/data, after a kill -9 half-way; and the
  same corpus prepared from local files into a local directory."""
  local = tmp_path_factory.mktemp("local_corpus")
  for i, text in enumerate(random_documents(60)):
    (local / f"{i:04d}.txt").write_text(text, encoding="utf-8")
    upload(f"corpus/{i:04d}.txt", text.encode("utf-8"))
  flags = ["--source=text", "--num_shards=4", "--validation_fraction=0.2", "--num_workers=1"]
  killed = forkserver.run([sys.executable, "-c", _PREPARE_ONE_SHARD, "--input=gs://bkt/corpus/*.txt",
                           "--output_dir=gs://bkt/data", *flags], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
  assert killed.returncode == -9, killed.stderr[-3000:]
  assert "manifest.json" not in blobs("data/")  # Unusable until done...
  rerun = run("levanter_flax.commands.prepare", "--input=gs://bkt/corpus/*.txt",
              "--output_dir=gs://bkt/data", *flags)
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  assert "Keeping 1 finished shards" in rerun.stderr  # ... and resumed, not redone.
  from levanter_flax.data import dataset_writer, sources
  return dataset_writer.prepare_dataset(dataset_writer.PrepareOptions(  # In this process: it costs no start-up.
      source=sources.SourceSpec(kind="text", inputs=(f"{local}/*.txt",)), output_dir=local / "data",
      num_shards=4, validation_fraction=0.2))


@pytest.mark.slow
def test_prepare_on_gcs_writes_what_it_writes_locally(gcs_dataset):
  written = blobs("data/")
  local = {p.name: p.read_bytes() for p in gcs_dataset.iterdir() if p.name != ".lock"}
  assert sorted(n for n in written if n.endswith(".tfrecord")) == sorted(
      n for n in local if n.endswith(".tfrecord"))
  for name in local:
    if name.endswith((".tfrecord", ".done.json")):
      assert written[name] == local[name], name
  remote_manifest, local_manifest = (json.loads(m["manifest.json"]) for m in (written, local))
  for manifest in (remote_manifest, local_manifest):
    del manifest["source"]["inputs"]
  assert remote_manifest == local_manifest
  assert ".lock" not in written  # Released.


# The trainer's command line, killed -9 once its step 4 checkpoint is written, before step 6's.
_TRAIN_THEN_DIE = """
import os, runpy, signal
from levanter_flax.checkpoint import store
save = store.Checkpointer.save
def save_or_die(self, step, *args, **kwargs):
  if step == 6:
    self._finish_writing()
    os.kill(os.getpid(), signal.SIGKILL)
  return save(self, step, *args, **kwargs)
store.Checkpointer.save = save_or_die
runpy.run_module("levanter_flax.main", run_name="__main__", alter_sys=True)
"""


@pytest.fixture(scope="module")
def gcs_run(gcs_dataset, tmp_path_factory):
  """gpt2_nano trained on gs://bkt/data into gs://bkt/run, profiled, killed -9 after its step 4
  checkpoint, which is then cut short, and resumed; and the same run into a local workdir,
  uninterrupted."""
  args = [*TRAIN, "--config.data.dataset=gs://bkt/data"]
  profiled = ["--config.monitoring.profiler=True", "--config.monitoring.profiler_start_step=2",
              "--config.monitoring.profiler_num_steps=1",
              "--config.trainer.jax_compilation_cache_dir=gs://bkt/jax-cache",
              "--config.trainer.jax_persistent_cache_min_compile_time_secs=0"]
  killed = forkserver.run([sys.executable, "-c", _TRAIN_THEN_DIE, "--workdir=gs://bkt/run", *args,
                           *profiled],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
  assert killed.returncode == -9, killed.stderr[-3000:]
  newest = blobs("run/checkpoints/4/")
  largest = max(newest, key=lambda n: len(newest[n]))
  upload(f"run/checkpoints/4/{largest}", newest[largest][:100])  # A cut upload.
  resumed = run("levanter_flax.main", "--workdir=gs://bkt/run", *args)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "Resuming from checkpoint 2 instead of the newer, damaged [4]" in resumed.stderr
  assert blobs("run/checkpoints/4.unreadable/")[largest] == newest[largest][:100]
  local = tmp_path_factory.mktemp("local_run")
  reference = run("levanter_flax.main", f"--workdir={local}", *args)
  assert reference.returncode == 0, reference.stderr[-3000:]
  return local


def losses(metrics: bytes) -> dict[int, float]:
  """The newest train loss per step: a resumed run logs the replayed steps again."""
  records = [json.loads(line) for line in metrics.decode().splitlines()]
  return {r["step"]: r["train/loss"] for r in records if "train/loss" in r}


@pytest.mark.slow
def test_a_gcs_run_killed_damaged_and_resumed_equals_a_local_one(gcs_run):
  written = blobs("run/")
  assert losses(written["metrics.jsonl"]) == losses((gcs_run / "metrics.jsonl").read_bytes())
  assert sorted(losses(written["metrics.jsonl"])) == [1, 2, 3, 4, 5, 6]
  assert json.loads(written["config.json"]) == json.loads((gcs_run / "config.json").read_text())
  assert {n.split("/")[1] for n in written if n.startswith("checkpoints/")} >= {"4", "6"}
  assert any(n.startswith("events.out.tfevents") for n in written)  # TensorBoard.
  assert any(re.fullmatch(r"plugins/profile/[^/]+/[^/]+\.xplane\.pb", n) for n in written)
  assert blobs("jax-cache/")  # jax writes its compilation cache to gs:// itself.
  assert ".lock" not in written


@pytest.mark.slow
def test_report_export_and_sample_read_a_gcs_run(gcs_run, tmp_path):
  from levanter_flax.hf import snapshot
  from levanter_flax.core import paths
  from levanter_flax.generate.trained import run_params
  report = run("levanter_flax.commands.report", "gs://bkt/run", "--output_dir=gs://bkt/report")
  assert report.returncode == 0, report.stderr[-3000:]
  assert re.search(r"gs://bkt/run/plugins/profile/\S+\.xplane\.pb: 1 steps in", report.stdout)
  assert {"loss_vs_step.png", "throughput.png"} <= set(blobs("report/"))
  exported = run("levanter_flax.commands.export_hf", "--workdir=gs://bkt/run",
                 "--output_dir=gs://bkt/hf")
  assert exported.returncode == 0, exported.stderr[-3000:]
  local_cfg, local_params, _ = run_params(gcs_run)  # As export_hf does, in this process.
  snapshot.save(local_cfg, local_params, tmp_path)
  cfg, params = snapshot.load(paths.resolve("gs://bkt/hf", "test"))
  local_cfg, local_params = snapshot.load(tmp_path)
  assert cfg == local_cfg
  for a, b in zip(*(np.concatenate([x.ravel() for x in _leaves(p)]) for p in (params, local_params))):
    assert a == b
  sampled = run("levanter_flax.commands.sample", "--workdir=gs://bkt/run", "--prompt=def ",
                "--max_new_tokens=4", "--temperature=0")
  assert sampled.returncode == 0, sampled.stderr[-3000:]
  assert sampled.stdout.startswith("--- 'def '\ndef ")


def _leaves(tree):
  import jax
  return jax.tree.leaves(tree)


@pytest.mark.slow
def test_two_processes_write_one_gcs_workdir(gcs_run):
  from test_multihost import finish, start_two
  finish(*start_two("gs://bkt/two", *TRAIN[1:], "--config.data.dataset=gs://bkt/data"))
  written = blobs("two/")
  reference, got = (losses(m) for m in ((gcs_run / "metrics.jsonl").read_bytes(),
                                         written["metrics.jsonl"]))
  assert sorted(got) == sorted(reference)
  for step, loss in got.items():
    assert loss == pytest.approx(reference[step], abs=1e-5)
  assert ".lock" not in written


def test_parquet_and_zst_inputs_on_gcs_read_as_local_ones(gcs, tmp_path):
  import io
  import pyarrow
  import zstandard
  from pyarrow import parquet
  from levanter_flax.data import dataset_writer, sources
  from test_prepare import read_documents
  texts = random_documents(20, seed=3)
  table = io.BytesIO()
  parquet.write_table(pyarrow.table({"text": texts[:10] + [None]}), table, row_group_size=4)
  upload("corpus2/a.parquet", table.getvalue())
  upload("corpus2/b.jsonl.zst", zstandard.compress(
      "\n".join(json.dumps({"text": t}) for t in texts[10:]).encode()))
  for kind, pattern, expected in (("parquet", "*.parquet", texts[:10]),
                                  ("jsonl", "*.jsonl.zst", texts[10:])):
    directory = dataset_writer.prepare_dataset(dataset_writer.PrepareOptions(
        source=sources.SourceSpec(kind=kind, inputs=(f"gs://bkt/corpus2/{pattern}",)),
        output_dir=tmp_path / kind, num_shards=2, validation_fraction=0.0))
    assert sorted(read_documents(directory)) == sorted(expected)


def test_a_tokenizer_file_on_gcs_is_read(gcs):
  from levanter_flax.core import paths
  from levanter_flax.data import tokenizers
  tokenizers.train_bpe(random_documents(30), 300, paths.resolve("gs://bkt/tok.json", "test"))
  tokenizer = tokenizers.load_tokenizer("gs://bkt/tok.json")
  assert tokenizer.decode(tokenizer.encode("doc0: abc")) == "doc0: abc"


@pytest.mark.parametrize("module, flag, fragment", [
    ("levanter_flax.main", "--workdir=gs://no-such-bucket/run",
     "--workdir gs://no-such-bucket/run: the bucket gs://no-such-bucket does not exist"),
    ("levanter_flax.commands.prepare", f"--output_dir=gs://{DENIED}/data",
     f"--output_dir gs://{DENIED}/data: permission denied on gs://{DENIED} (403"),
])
def test_a_missing_bucket_or_a_permission_error_is_one_line(gcs, module, flag, fragment):
  args = [f"--config={NANO}"] if module.endswith("main") else ["--source=text",
                                                               "--input=gs://bkt/corpus/*.txt"]
  assert_one_line_error(run(module, *args, flag, timeout=120), fragment)


def test_s3_is_refused_saying_why():
  from levanter_flax.core import paths
  from levanter_flax.core.errors import UserError
  with pytest.raises(UserError, match=r"^--workdir s3://bkt/run: s3:// paths are not supported: "
                                      r"TensorFlow 2.21 has no S3 filesystem"):
    paths.resolve("s3://bkt/run", "--workdir")


def test_missing_credentials_are_one_line(gcs, tmp_path):
  env = {k: v for k, v in os.environ.items()
         if k not in ("STORAGE_EMULATOR_HOST", "GOOGLE_AUTH_TOKEN_FOR_TESTING",
                      "GOOGLE_APPLICATION_CREDENTIALS")}
  result = forkserver.run([sys.executable, "-m", "levanter_flax.main", f"--config={NANO}",
                           "--workdir=gs://bkt/run2"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**env, "HOME": str(tmp_path)})
  assert_one_line_error(result, "--workdir gs://bkt/run2: no Google Cloud credentials")


def test_a_lock_on_gcs_refuses_a_second_holder_and_frees_a_dead_ones(gcs):
  from levanter_flax.core import locks, paths
  directory = paths.resolve("gs://bkt/locked", "test")
  first, second = (locks.DirectoryLock(directory, "workdir") for _ in range(2))
  assert first.try_acquire()
  assert not second.try_acquire()
  assert f"is in use by pid {os.getpid()}" in str(second.refusal())
  first.release()
  assert second.try_acquire()
  second.release()
  assert kill_a_holder("os.kill(os.getpid(), 9)") == -9
  # Its renewer deletes the lock at once: a run on another host need not wait for it to expire.
  deadline = time.monotonic() + 30
  while ".lock" in blobs("locked/") and time.monotonic() < deadline:
    time.sleep(0.1)
  assert ".lock" not in blobs("locked/")
  assert kill_a_holder("os.killpg(0, 9)") == -9  # With its renewer.
  assert ".lock" in blobs("locked/")
  assert first.try_acquire()  # Its holder is a dead process on this host.
  first.release()


def kill_a_holder(kill: str) -> int:
  """The exit status of a process that takes the lock of gs://bkt/locked, then runs `kill`."""
  return forkserver.run([sys.executable, "-c", (
      "import os; from etils import epath; from levanter_flax.core import locks\n"
      "lock = locks.DirectoryLock(epath.Path('gs://bkt/locked'), 'workdir')\n"
      f"assert lock.try_acquire(); {kill}")], cwd=REPO, timeout=120,
                        start_new_session=True).returncode


@pytest.mark.slow
def test_a_launch_under_a_gcs_root_runs_and_a_rerun_skips(gcs_dataset, tmp_path):
  from test_launch import launch, write_experiment
  unit = {"trainer.num_train_steps": 2, "trainer.batch_size": 8,
          "data.dataset": "gs://bkt/data", "data.reader_groups": 1}
  experiment = write_experiment(tmp_path / "exp.py", [unit])
  first = launch(experiment, "gs://bkt/launch")
  assert first.returncode == 0, first.stdout + first.stderr[-3000:]
  assert "] finished (exit 0)" in first.stdout
  written = blobs("launch/tiny/")
  assert any(n.endswith("/checkpoints/2/_CHECKPOINT_METADATA") for n in written)
  assert any(n.endswith("/log.txt") and b"levanter_flax.main" in written[n] for n in written)
  again = launch(experiment, "gs://bkt/launch")
  assert again.returncode == 0, again.stderr[-3000:]
  assert "] done in an earlier launch" in again.stdout



OTHER_HOLDER = {"host": "elsewhere", "pid": 4242, "since": "2026-01-01T00:00:00+00:00"}


def paused(pause_dir) -> dict[str, str]:
  """The environment of tests/paused_main.py: the trainer, paused after its step 2 checkpoint."""
  return {"PYTHONPATH": str(REPO / "tests"), "PAUSE_DIR": str(pause_dir)}


def wait_for(path, process: subprocess.Popen, log, seconds: float = 240) -> None:
  deadline = time.monotonic() + seconds
  while not path.exists():
    assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
    time.sleep(0.1)


@pytest.mark.slow
def test_a_run_whose_gcs_lock_is_taken_stops_before_its_next_write(gcs, data_cache, tmp_path,
                                                                   monkeypatch):
  """Frozen past the lease (as by a thread that holds the GIL), it keeps its lock; once the lock
  is another run's, it stops with one line and writes nothing more; then a new run resumes."""
  from levanter_flax.core import locks, paths
  monkeypatch.setattr(locks._ObjectLease, "LEASE_SECONDS", 2)  # For this process's takers.
  flags = [f"--config={NANO}", "--workdir=gs://bkt/taken", *TINY, "--config.trainer.batch_size=8",
           "--config.trainer.num_train_steps=4", "--config.checkpoint.every_steps=2",
           "--config.data.reader_groups=1", f"--config.data.cache_dir={data_cache}"]
  log = tmp_path / "stderr.txt"
  with open(log, "w", encoding="utf-8") as stderr:
    trainer = forkserver.Popen([sys.executable, "-m", "paused_main", *flags], cwd=REPO,
                               env={**os.environ, **paused(tmp_path)}, stderr=stderr)
  try:
    wait_for(tmp_path / "paused_0", trainer, log)
    written = blobs("taken/")
    trainer.send_signal(signal.SIGSTOP)  # No thread of it runs; its renewer does.
    time.sleep(3)
    taker = locks.DirectoryLock(paths.resolve("gs://bkt/taken", "test"), "workdir")
    assert not taker.try_acquire()
    trainer.send_signal(signal.SIGCONT)
    upload("taken/.lock", json.dumps(OTHER_HOLDER).encode())
    (tmp_path / "go").touch()
    trainer.wait(timeout=120)
  finally:
    trainer.kill()
  assert_one_line_error(
      subprocess.CompletedProcess([], trainer.returncode, "", log.read_text()),
      "lost workdir gs://bkt/taken: pid 4242 on elsewhere (since 2026-01-01T00:00:00+00:00) took "
      "over its lock gs://bkt/taken/.lock; stopped before writing anything more")
  after = blobs("taken/")
  assert json.loads(after.pop(".lock")) == OTHER_HOLDER
  assert after == {n: b for n, b in written.items() if n != ".lock"}  # Nothing written since.
  from google.cloud import storage
  storage.Client().bucket("bkt").blob("taken/.lock").delete()  # The other run is done.
  resumed = run("levanter_flax.main", *flags)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "Resuming from checkpoint at step 2" in resumed.stderr
  assert sorted(losses(blobs("taken/")["metrics.jsonl"])) == [1, 2, 3, 4]
  assert ".lock" not in blobs("taken/")


@pytest.mark.slow
def test_a_lock_renewal_that_fails_for_a_moment_keeps_the_gcs_lock(gcs, monkeypatch):
  """Storage that answers nothing for longer than a request's retries, and then the renewals'
  requests that it answers late, do not cost the lock."""
  from levanter_flax.core import locks, paths
  for timing, seconds in (("LEASE_SECONDS", 2), ("RENEW_SECONDS", 0.3), ("REQUEST_SECONDS", 1),
                          ("ATTEMPT_SECONDS", 0.5)):
    monkeypatch.setattr(locks._ObjectLease, timing, seconds)
  directory = paths.resolve("gs://bkt/flaky", "test")
  holder, taker = (locks.DirectoryLock(directory, "workdir") for _ in range(2))
  assert holder.try_acquire()
  try:
    gcs._proxy.send_signal(signal.SIGSTOP)  # Cloud Storage unreachable for 3 s.
    time.sleep(3)
    gcs._proxy.send_signal(signal.SIGCONT)
    time.sleep(3)  # More than the lease: the renewals went on.
    assert not taker.try_acquire()
    assert holder.lost() is None
  finally:
    gcs._proxy.send_signal(signal.SIGCONT)
    holder.release()
  assert taker.try_acquire()
  taker.release()


@pytest.mark.slow
def test_a_job_of_two_processes_whose_gcs_lock_is_taken_stops_on_both(gcs, data_cache, tmp_path):
  """Process 0 finds the lock lost before its next metrics write and skips it; both stop together
  at the next checkpoint, writing nothing, each with one line."""
  from levanter_flax.core import locks
  from test_multihost import start_two
  processes = start_two("gs://bkt/taken2", f"--config.data.cache_dir={data_cache}",
                        "--config.trainer.num_train_steps=6",
                        "--config.checkpoint.every_steps=2",
                        "--config.data.reader_groups=2", module="paused_main",
                        env=paused(tmp_path))
  try:
    deadline = time.monotonic() + 240
    while not (tmp_path / "paused_0").exists():
      assert all(p.poll() is None for p in processes) and time.monotonic() < deadline
      time.sleep(0.1)
    written = blobs("taken2/")
    upload("taken2/.lock", json.dumps(OTHER_HOLDER).encode())
    # A run takes a lock over only once its lease has expired, long after the holder last read
    # it as its own; this takeover, forced, must come later than the holder trusts that read.
    time.sleep(locks._ONE_LOG_STEP_SECONDS)  # pylint: disable=protected-access
    (tmp_path / "go").touch()
    outputs = [p.communicate(timeout=120) for p in processes]
    results = [subprocess.CompletedProcess([], p.returncode, *o) for p, o in zip(processes, outputs)]
  finally:
    for process in processes:
      process.kill()
  assert_one_line_error(results[0], "lost workdir gs://bkt/taken2: pid 4242 on elsewhere (since "
                                    "2026-01-01T00:00:00+00:00) took over its lock")
  assert_one_line_error(results[1], "lost workdir gs://bkt/taken2: its lock is no longer this "
                                    "job's; process 0's log names the new holder")
  after = blobs("taken2/")
  assert json.loads(after.pop(".lock")) == OTHER_HOLDER
  assert after == {n: b for n, b in written.items() if n != ".lock"}
