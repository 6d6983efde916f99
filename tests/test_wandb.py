"""Weights & Biases, offline: the scalars TensorBoard gets and the run's settings land in W&B's
own run files, and a restart, killed or not, logs to the same W&B run."""
import contextlib
import json
import pathlib
import signal
import struct
import sys

import pytest

from conftest import read_metrics
from levanter_flax.monitoring import metrics, wandb_writer
from levanter_flax.monitoring.wandb_config import _tags as config_tags  # pylint: disable=protected-access
from levanter_flax.config import flat_dict, to_run_config
from levanter_flax.core.errors import UserError
from levanter_flax.training.loop import train_and_evaluate
from test_main import NANO, TINY, assert_one_line_error, run_main
from test_gcs import blobs, gcs  # pylint: disable=unused-import  # gcs: a fixture.
from test_resume import run_killed_after_checkpoint

PROJECT = "levanter-flax-tests"



def writer_settings(run) -> dict:
  """create_writer's keywords for a run, as the loop passes them."""
  return {"settings": flat_dict(run), "wandb": run.trainer.wandb}

@pytest.fixture(autouse=True)
def offline_wandb(monkeypatch, tmp_path_factory):
  """W&B never reaches the network, reads no user's settings and prints nothing."""
  home = tmp_path_factory.mktemp("wandb_home")
  # WANDB_SERVICE: set by an earlier test's wandb.init in this process, it would lead a
  # trainer started from here to this process's W&B service, which outlives a killed trainer
  # with its run still open ("run ID ... is in use" on the rerun).
  for name in ("WANDB_DIR", "WANDB_MODE", "WANDB_API_KEY", "WANDB_PROJECT", "WANDB_ENTITY",
               "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_SERVICE"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("WANDB_SILENT", "true")
  monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / "config"))
  monkeypatch.setenv("WANDB_CACHE_DIR", str(home / "cache"))
  monkeypatch.setenv("WANDB_DATA_DIR", str(home / "data"))
  monkeypatch.setenv("NETRC", str(home / "netrc"))  # None there: no API key from ~/.netrc.
  # W&B keeps its settings in a process-wide singleton: an earlier test's (another file's, or an
  # online run's that failed to log in) must not decide this one's. Seen once in CI: an offline
  # run that tried to log in and wrote no run record.
  if sys.modules.get("wandb") is not None:
    sys.modules["wandb"].teardown()


# --- Reading W&B's run files back, as `wandb sync` does. ---
# A run's .wandb file is W&B's record log (LevelDB's log format under a 7-byte W&B header):
# 32 KiB blocks of chunks, each a (crc32c, length, type) header and a piece of one serialized
# wandb_internal_pb2.Record; a record too long for its block is split FIRST, MIDDLE..., LAST.
_FILE_HEADER, _BLOCK, _CHUNK_HEADER = 7, 32768, 7
_FULL, _LAST = 1, 4


def wandb_records(run_dir: pathlib.Path) -> list:
  from wandb.proto import wandb_internal_pb2
  # W&B's service writes the run file after run.finish() returns (seen in CI: read too soon, it
  # held no run record yet); its teardown waits for it to finish.
  sys.modules["wandb"].teardown()
  (path,) = run_dir.glob("*.wandb")
  data = path.read_bytes()
  assert data[:4] == b":W&B", path
  records, pieces, at = [], [], _FILE_HEADER
  while at + _CHUNK_HEADER <= len(data):
    if _BLOCK - at % _BLOCK < _CHUNK_HEADER:  # The rest of a block too short for a header.
      at += _BLOCK - at % _BLOCK
      continue
    _, length, kind = struct.unpack("<IHB", data[at:at + _CHUNK_HEADER])
    at += _CHUNK_HEADER
    pieces.append(data[at:at + length])
    at += length
    if kind in (_FULL, _LAST):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(b"".join(pieces))
      records.append(record)
      pieces = []
  return records


def run_dirs(workdir: pathlib.Path) -> list[pathlib.Path]:
  """One per start of the run, oldest first (their names start with the time)."""
  return sorted((workdir / "wandb").glob("offline-run-*"))


def wandb_run(run_dir: pathlib.Path):
  (run,) = [r.run for r in wandb_records(run_dir) if r.WhichOneof("record_type") == "run"]
  return run


def wandb_history(run_dir: pathlib.Path) -> dict[int, dict[str, float]]:
  """Step -> what was logged at it, W&B's own keys (_step, _runtime, ...) left out."""
  history = {}
  for record in wandb_records(run_dir):
    if record.WhichOneof("record_type") == "history":
      row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
             for item in record.history.item}
      history[record.history.step.num] = {k: v for k, v in row.items() if not k.startswith("_")}
  return history


def wandb_config(run_dir: pathlib.Path) -> dict:
  """The run's config: what init gave it, then each update."""
  config = {}
  for record in wandb_records(run_dir):
    kind = record.WhichOneof("record_type")
    updates = (record.run.config.update if kind == "run" else
               record.config.update if kind == "config" else [])
    config |= {item.key: json.loads(item.value_json) for item in updates}
  return config


def jsonl_by_step(workdir: pathlib.Path) -> dict[int, dict[str, float]]:
  """metrics.jsonl's scalars, the writes at one step together, as W&B rows them."""
  rows = {}
  for record in read_metrics(workdir):
    rows.setdefault(record["step"], {}).update(
        {k: v for k, v in record.items() if k not in ("step", "time")})
  return rows


def tensorboard_hparams(workdir: pathlib.Path) -> dict:
  import tensorflow as tf
  from tensorboard.plugins.hparams import metadata
  found = {}
  for events in workdir.glob("events.out.tfevents.*"):
    for event in tf.compat.v1.train.summary_iterator(str(events)):
      for value in event.summary.value:
        if value.tag == metadata.SESSION_START_INFO_TAG:
          info = metadata.parse_session_start_info_plugin_data(
              value.metadata.plugin_data.content)
          found |= {k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind"))
                    for k, v in info.hparams.items()}
  return found


def with_wandb(config, mode="offline", **settings):
  config.trainer.wandb.project = PROJECT
  config.trainer.wandb.mode = mode
  for key, value in settings.items():
    config.trainer.wandb[key] = value
  return config


# --- The tests. ---

@pytest.mark.slow
def test_an_offline_run_logs_tensorboards_scalars_and_the_settings(tiny_config, tmp_path):
  tiny_config.trainer.num_train_steps = 4
  tiny_config.trainer.eval_every_steps = 2
  tiny_config.checkpoint.every_steps = 4
  workdir = tmp_path / "nano_run"
  train_and_evaluate(to_run_config(with_wandb(tiny_config, tags="baseline, tiny")), workdir)

  (run_dir,) = run_dirs(workdir)
  run = wandb_run(run_dir)
  assert run.run_id == (workdir / "wandb_run_id").read_text().strip()
  assert (run.project, run.display_name, list(run.tags)) == (PROJECT, "nano_run",
                                                             ["baseline", "tiny"])
  # Every scalar of metrics.jsonl (what TensorBoard gets too), at its step, and nothing else.
  logged, history = jsonl_by_step(workdir), wandb_history(run_dir)
  assert history == logged
  assert [s for s, row in history.items() if "train/loss" in row] == [1, 2, 3, 4]
  assert [s for s, row in history.items() if "eval/loss" in row] == [2, 4]
  # The settings: config.json's, each key and value.
  saved = json.loads((workdir / "config.json").read_text())
  config = wandb_config(run_dir)
  assert {k: config[k] for k in saved} == saved
  assert config["trainer.wandb.tags"] == ["baseline", "tiny"]
  assert config["model.num_layers"] == 2 and config["trainer.num_train_steps"] == 4
  # TensorBoard holds them as hparams: lists as their JSON.
  hparams = tensorboard_hparams(workdir)
  assert hparams == metrics.tensorboard_hparams(saved)
  assert hparams["model.num_layers"] == 2 and hparams["trainer.device_mesh"] == json.dumps(
      saved["trainer.device_mesh"])


@pytest.mark.slow
def test_a_kill_and_each_rerun_continue_the_same_wandb_run(data_cache, tmp_path):
  flags = [f"--config.data.cache_dir={data_cache}", "--config.trainer.batch_size=8",
           "--config.trainer.num_train_steps=4", "--config.trainer.eval_every_steps=2",
           "--config.checkpoint.every_steps=2", "--config.data.reader_groups=1",
           f"--config.trainer.wandb.project={PROJECT}", "--config.trainer.wandb.mode=offline"]
  killed = run_killed_after_checkpoint(tmp_path, 2, *flags)
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
  id_file = tmp_path / "wandb_run_id"
  run_id = id_file.read_text().strip()
  # Its run directory is named for the id. (What it logged may not have reached its .wandb file:
  # W&B writes it every 15 s, and its service, orphaned, exits without writing the rest.)
  (killed_dir,) = run_dirs(tmp_path)
  assert killed_dir.name.endswith(f"-{run_id}")

  id_file.chmod(0o444)  # Read, never written again: a read-only copy serves as well.
  resumed = run_killed_after_checkpoint(tmp_path, None, *flags)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  (resumed_dir,) = set(run_dirs(tmp_path)) - {killed_dir}
  assert wandb_run(resumed_dir).run_id == run_id and wandb_run(resumed_dir).resume
  # The rerun logged steps 3 and 4 (and the eval the kill lost at 2) to that run.
  continued = wandb_history(resumed_dir)
  assert {3, 4} <= set(continued) and "eval/loss" in continued[2]
  rows = jsonl_by_step(tmp_path)
  for step, row in continued.items():
    assert rows[step].items() >= row.items()

  finished = run_main(f"--config={NANO}", f"--workdir={tmp_path}", *TINY, *flags)
  assert finished.returncode == 0 and "Already finished" in finished.stderr, finished.stderr[-2000:]
  assert id_file.read_text().strip() == run_id and len(run_dirs(tmp_path)) == 2
  # Extended, it goes on in the same W&B run too.
  extended = run_main(f"--config={NANO}", f"--workdir={tmp_path}", *TINY, *flags,
                      "--config.trainer.num_train_steps=6")
  assert extended.returncode == 0, extended.stderr[-2000:]
  (extended_dir,) = set(run_dirs(tmp_path)) - {killed_dir, resumed_dir}
  assert wandb_run(extended_dir).run_id == run_id
  assert [s for s, row in wandb_history(extended_dir).items() if "train/loss" in row] == [5, 6]
  assert wandb_config(extended_dir)["trainer.num_train_steps"] == 6


def test_a_mode_other_than_the_three_is_one_line(tmp_path):
  result = run_main(f"--config={NANO}", f"--workdir={tmp_path}",
                    f"--config.trainer.wandb.project={PROJECT}",
                    "--config.trainer.wandb.mode=offine")
  assert_one_line_error(result, "config.trainer.wandb.mode must be one of online, offline, "
                                "disabled; got 'offine'")
  assert not list(tmp_path.iterdir())


def test_tags_are_comma_separated(tiny_config):
  assert to_run_config(with_wandb(tiny_config, tags="a, b,,c")).trainer.wandb.tags == (
      "a", "b", "c")
  assert to_run_config(with_wandb(tiny_config, tags="")).trainer.wandb.tags == ()
  tags = config_tags
  assert tags("config.trainer.wandb.tags", ["x"]) == ("x",)  # As a config.json holds them.
  assert tags("config.trainer.wandb.tags", '["a", "b,c"]') == ("a", "b,c")  # A flag's list.
  with pytest.raises(UserError, match=r"must be tags.*got '\[\"a\"'$"):
    tags("config.trainer.wandb.tags", '["a"')
  with pytest.raises(UserError, match=r"config key config.trainer.wandb.tags must be tags"):
    tags("config.trainer.wandb.tags", [1])


def test_without_a_project_or_when_disabled_nothing_reaches_wandb(tiny_config, tmp_path,
                                                                  monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)  # Any import of it fails.
  for workdir, run in ((tmp_path / "none", to_run_config(tiny_config)),
                       (tmp_path / "off", to_run_config(with_wandb(tiny_config, "disabled")))):
    workdir.mkdir()
    with contextlib.closing(metrics.create_writer(workdir, **writer_settings(run))) as writer:
      writer.write_scalars(1, {"train/loss": 1.0})
    assert not (workdir / "wandb").exists() and not (workdir / "wandb_run_id").exists()
    assert tensorboard_hparams(workdir)["trainer.wandb.mode"] == run.trainer.wandb.mode


def test_a_gcs_workdir_keeps_the_run_id_in_the_bucket(gcs, tiny_config, tmp_path, monkeypatch):
  """W&B cannot write gs://: its files go to $WANDB_DIR (else the current directory)."""
  from etils import epath
  monkeypatch.setenv("WANDB_DIR", str(tmp_path))
  run = to_run_config(with_wandb(tiny_config))
  with contextlib.closing(metrics.create_writer(epath.Path("gs://bkt/wandb_run"), **writer_settings(run))) as w:
    w.write_scalars(3, {"train/loss": 0.5})
  run_id = blobs("wandb_run/")["wandb_run_id"].decode().strip()
  (run_dir,) = run_dirs(tmp_path)
  assert (wandb_run(run_dir).run_id, wandb_run(run_dir).display_name) == (run_id, "wandb_run")
  assert wandb_history(run_dir) == {3: {"train/loss": 0.5}}


def test_only_process_0_talks_to_wandb(tiny_config, tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)  # Any import of it fails.
  monkeypatch.setattr(metrics.jax, "process_index", lambda: 1)
  with contextlib.closing(metrics.create_writer(
      tmp_path, **writer_settings(to_run_config(with_wandb(tiny_config))))) as writer:
    writer.write_scalars(1, {"train/loss": 1.0})
  assert not list(tmp_path.iterdir())  # No id file, no W&B files, no TensorBoard events.


def test_wandb_missing_is_one_line_naming_the_extra(tiny_config, tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)
  with pytest.raises(UserError, match=r"^config.trainer.wandb.project is set but wandb is not "
                                      r"installed: pip install levanter_flax\[wandb\]$"):
    metrics.create_writer(tmp_path, **writer_settings(to_run_config(with_wandb(tiny_config))))
  assert not list(tmp_path.glob("events.out.tfevents.*"))


def test_online_without_an_api_key_is_one_line_suggesting_offline(tiny_config, tmp_path):
  with pytest.raises(UserError, match=r"^W&B could not open run \w+ of project "
                                      rf"'{PROJECT}' \(online\): No API key configured\. Use "
                                      r"`wandb login` to log in; config.trainer.wandb.mode=offline "
                                      r"logs locally, to upload later with `wandb sync`$"):
    metrics.create_writer(tmp_path, **writer_settings(to_run_config(with_wandb(tiny_config, "online"))))


def test_a_run_id_file_that_holds_no_id_is_one_line(tmp_path):
  (tmp_path / "wandb_run_id").write_text("my run?\n")
  with pytest.raises(UserError, match=r"the W&B run id file .*wandb_run_id holds 'my run\?', not "
                                      r"a run id .*; delete it to start a new W&B run"):
    wandb_writer.run_id(tmp_path)
  (tmp_path / "wandb_run_id").unlink()
  (tmp_path / "wandb_run_id").mkdir()
  with pytest.raises(UserError, match=r"cannot read the W&B run id file .*wandb_run_id: "):
    wandb_writer.run_id(tmp_path)


def test_the_run_id_is_chosen_once_per_workdir(tmp_path):
  (tmp_path / "a").mkdir()
  (tmp_path / "b").mkdir()
  first = wandb_writer.run_id(tmp_path / "a")
  assert first == wandb_writer.run_id(tmp_path / "a") == (
      tmp_path / "a" / "wandb_run_id").read_text().strip()
  assert wandb_writer.run_id(tmp_path / "b") != first
  assert [p.name for p in (tmp_path / "a").iterdir()] == ["wandb_run_id"]  # No temp file left.


def test_a_run_that_fails_is_marked_failed_and_wandb_dir_is_respected(tiny_config, tmp_path,
                                                                      monkeypatch):
  monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
  (tmp_path / "wandb_dir").mkdir()
  run = to_run_config(with_wandb(tiny_config, name="named"))
  with pytest.raises(RuntimeError, match="the step failed"):
    with contextlib.closing(metrics.create_writer(tmp_path, **writer_settings(run))) as writer:
      writer.write_scalars(1, {"train/loss": 2.5})
      raise RuntimeError("the step failed")
  assert not (tmp_path / "wandb").exists()
  (run_dir,) = run_dirs(tmp_path / "wandb_dir")
  assert wandb_run(run_dir).display_name == "named"
  assert wandb_history(run_dir) == {1: {"train/loss": 2.5}}
  (exit_record,) = [r.exit for r in wandb_records(run_dir) if r.WhichOneof("record_type") == "exit"]
  assert exit_record.exit_code == 1
