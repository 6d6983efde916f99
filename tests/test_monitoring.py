"""The profiler window, health metrics, the hang watchdog and the report of runs."""
import ctypes
import glob
import json
import logging
import re
import statistics
import sys
import time

import optax
import orbax.checkpoint as ocp
import pytest
from jax.profiler import ProfileData

import forkserver
from conftest import REPO, read_metrics
from levanter_flax.monitoring import watch
from levanter_flax.monitoring import report
from levanter_flax.monitoring import history
from levanter_flax.config import to_run_config
from levanter_flax.data import loader
from levanter_flax.core.errors import UserError
from levanter_flax.training.loop import train_and_evaluate


def trace_event_names(workdir) -> set[str]:
  [trace] = glob.glob(f"{workdir}/plugins/profile/*/*.xplane.pb")
  return {event.name for plane in ProfileData.from_file(trace).planes
          for line in plane.lines for event in line.events}


@pytest.mark.slow
def test_profiler_traces_its_window_with_the_loop_annotated(tiny_config, tmp_path):
  tiny_config.trainer.num_train_steps = 6
  tiny_config.monitoring.profiler = True
  tiny_config.monitoring.profiler_start_step = 4
  tiny_config.monitoring.profiler_num_steps = 2  # Steps 4 and 5; step 5 evaluates and checkpoints.
  train_and_evaluate(to_run_config(tiny_config), tmp_path / "on")
  assert {"train", "data_wait", "eval", "checkpoint"} <= trace_event_names(tmp_path / "on")
  summary = report.profile_summary(tmp_path / "on")
  assert re.search(r": 2 steps in [\d.]+ ms", summary), summary
  for phase in ("data_wait", "eval", "checkpoint"):
    # The share is rounded to 0.1%, and the data wait of a tiny run can round to 0.0.
    share = re.search(rf"{phase} +([\d.]+) ms +([\d.]+)% of the window", summary)
    assert share and float(share.group(1)) > 0 and float(share.group(2)) < 100, summary
  assert "XLA " in summary
  tiny_config.monitoring.profiler = False
  train_and_evaluate(to_run_config(tiny_config), tmp_path / "off")
  assert not (tmp_path / "off" / "plugins").exists()


@pytest.mark.slow
def test_health_metrics_are_logged_and_the_param_norm_is_the_saved_params(tiny_config, tmp_path):
  tiny_config.trainer.num_train_steps = 5
  train_and_evaluate(to_run_config(tiny_config), tmp_path)
  last = [m for m in read_metrics(tmp_path) if "train/loss" in m][-1]
  assert last["memory/host_rss_bytes"] > 100e6  # At least jax and TF are resident.
  assert last["train/grad_norm"] > 0 and last["train/update_norm"] > 0
  saved = ocp.StandardCheckpointer().restore((tmp_path / "checkpoints" / "5" / "state").absolute())
  assert last["train/param_norm"] == pytest.approx(float(optax.tree.norm(saved["params"])), rel=1e-5)
  progress = {k for m in read_metrics(tmp_path) for k in m}
  assert {"steps_per_sec", "uptime", history.RUN_START} <= progress


@pytest.mark.slow
def test_watchdog_dumps_the_stacks_when_a_step_hangs(tiny_config, tmp_path, monkeypatch, caplog):
  next_batch = loader.TrainBatches.__next__
  calls = []

  def stalled_input_pipeline(self):
    calls.append(1)
    if len(calls) == 3:
      time.sleep(3.0)
    return next_batch(self)

  monkeypatch.setattr(loader.TrainBatches, "__next__", stalled_input_pipeline)
  tiny_config.trainer.num_train_steps = 4
  tiny_config.monitoring.hang_watchdog_seconds = 1.0
  with caplog.at_level(logging.WARNING):
    train_and_evaluate(to_run_config(tiny_config), tmp_path)
  dumps = [r.getMessage() for r in caplog.records if "Hang watchdog" in r.getMessage()]
  assert any("since step 2" in d and "in stalled_input_pipeline" in d and "Thread MainThread" in d
             for d in dumps), dumps


def test_watchdog_dumps_the_stacks_when_a_step_hangs_holding_the_gil(capfd):
  """Where the watching thread cannot run: a step stuck in a C call that keeps the GIL."""
  libc = ctypes.PyDLL(None)  # Unlike CDLL, it keeps the GIL for the call.

  def step_stuck_in_c():
    libc.sleep(2)

  with watch.HangWatchdog(1.0) as watchdog:
    watchdog.step_finished(1)
    step_stuck_in_c()
  stderr = capfd.readouterr().err  # The process's own: file descriptor 2.
  assert "Timeout (0:00:01)!" in stderr and "in step_stuck_in_c" in stderr, stderr


@pytest.mark.slow
def test_report_plots_runs_together_and_its_table_matches_the_metrics(tiny_config, tmp_path, capsys):
  tiny_config.trainer.num_train_steps = 4
  tiny_config.trainer.eval_every_steps = 2
  train_and_evaluate(to_run_config(tiny_config), tmp_path / "before")
  tiny_config.optimizer.learning_rate = 1e-2
  tiny_config.trainer.num_train_steps = 2
  train_and_evaluate(to_run_config(tiny_config), tmp_path / "after")
  tiny_config.trainer.num_train_steps = 4  # Resumed: one restart.
  train_and_evaluate(to_run_config(tiny_config), tmp_path / "after")

  text = report.report([tmp_path / "before", tmp_path / "after"], tmp_path / "plots")
  for name in ("loss_vs_step", "loss_vs_tokens", "throughput", "learning_rate"):
    png = (tmp_path / "plots" / f"{name}.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000, name
  header, *rows = text.split("\n\n")[0].splitlines()
  columns = re.split(r"\s{2,}", header.strip())
  for row, run in zip(rows, ["before", "after"]):
    got = dict(zip(columns, re.split(r"\s{2,}", row.strip())))
    records = read_metrics(tmp_path / run)
    evals = [m["eval/loss"] for m in records if "eval/loss" in m]
    assert got["run"] == run
    assert float(got["final eval loss"]) == pytest.approx(evals[-1], abs=1e-4)
    assert float(got["best eval loss"]) == pytest.approx(min(evals), abs=1e-4)
    assert int(got["tokens"]) == 4 * 8 * 64
    assert got["restarts"] == ("1" if run == "after" else "0")
    assert got["NaN skips"] == "0"
    assert got["median MFU"] == "-"  # No peak FLOP/s is known for a CPU.
    # The median is over each step's newest value.
    newest = {m["step"]: m["train/tokens_per_second"] for m in records if "train/tokens_per_second" in m}
    assert float(got["median tokens/s"]) == pytest.approx(statistics.median(newest.values()), abs=0.1)
    assert float(got["wall time (s)"]) > 0


def test_report_names_a_directory_without_metrics(tmp_path):
  result = forkserver.run([sys.executable, "-m", "levanter_flax.commands.report", str(tmp_path)],
                          cwd=REPO,
                          capture_output=True, text=True, timeout=60)
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1] == (
      f"levanter_flax: error: {tmp_path} has no metrics.jsonl: not a levanter_flax workdir, or its "
      f"run has not logged a step yet")


def test_profiler_window_after_the_last_step_is_refused(tiny_config):
  tiny_config.monitoring.profiler = True
  tiny_config.monitoring.profiler_start_step = 11
  with pytest.raises(UserError, match=r"config.monitoring.profiler_start_step \(11\) is after the last "
                                      r"step, config.trainer.num_train_steps \(10\)"):
    to_run_config(tiny_config)


def test_report_names_bad_records_and_an_unwritable_output_dir(tmp_path):
  run = tmp_path / "run"
  run.mkdir()
  good = [{"step": 1, "time": 1.0, "eval/loss": float("nan")}, {"step": 2, "time": 2.0, "eval/loss": 2.5}]
  for bad in ('{"step": 1e400}', '{"step": 3, "train/loss": null}', '{"step": 3, "x": [1]}'):
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in good) + bad + "\n")
    with pytest.raises(UserError, match=f"{run}/metrics.jsonl:3 is not a metrics record"):
      history.load_run(run, "run")
  (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in good))
  assert report.summary(history.load_run(run, "run"))["best eval loss"] == 2.5  # NaN is no best.
  (tmp_path / "a_file").write_text("")
  with pytest.raises(UserError, match=f"cannot create --output_dir {tmp_path}/a_file/plots"):
    report.report([run], tmp_path / "a_file" / "plots")
