"""Several processes joined by jax.distributed (gloo on 127.0.0.1) train as one process does."""
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

import forkserver
from conftest import REPO, as_at_checkpoint, read_metrics, train_losses, xla_flags
from test_main import NANO, TINY

# With the default reader groups (TINY's one could not be split over the processes).
STEPS = ["--config.data.reader_groups=0", "--config.trainer.batch_size=8",
         "--config.trainer.num_train_steps=5", "--config.trainer.eval_every_steps=5",
         "--config.checkpoint.every_steps=5"]


def free_address() -> str:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return f"127.0.0.1:{s.getsockname()[1]}"


def start(workdir, devices: int, *flags, module="levanter_flax.main", env=(),
          **distributed) -> subprocess.Popen:
  env = {**os.environ, "XLA_FLAGS": xla_flags(devices), **dict(env)}
  extra = [f"--config.trainer.distributed.{k}={v}" for k, v in distributed.items()]
  return forkserver.Popen([sys.executable, "-m", module, f"--config={NANO}",
                           f"--workdir={workdir}", *TINY, *STEPS, *flags, *extra], cwd=REPO,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(*processes: subprocess.Popen) -> list[str]:
  """Each process's stderr, once all have exited 0."""
  outputs = [p.communicate(timeout=300)[1] for p in processes]
  for process, stderr in zip(processes, outputs):
    assert process.returncode == 0, stderr[-3000:]
  return outputs


def start_two(workdir, *flags, **kwargs) -> list[subprocess.Popen]:
  address = free_address()
  return [start(workdir, 2, *flags, coordinator_address=address, num_processes=2, process_id=i,
                **kwargs) for i in range(2)]


def two_processes(workdir, *flags) -> list[str]:
  return finish(*start_two(workdir, *flags))


def one_process(workdir, *flags) -> str:
  return finish(start(workdir, 4, *flags))[0]


def eval_losses(workdir) -> dict[int, float]:
  return {m["step"]: m["eval/loss"] for m in read_metrics(workdir) if "eval/loss" in m}


@pytest.mark.slow
def test_a_run_resumes_exactly_on_another_process_count_by_default(data_cache, tmp_path):
  """1 x 4 devices -> 2 x 2 and back, with the default reader groups: one uninterrupted stream."""
  flags = [f"--config.data.cache_dir={data_cache}", "--config.trainer.device_mesh.data=4",
           "--config.checkpoint.every_steps=3", "--config.trainer.eval_every_steps=3",
           "--config.trainer.num_train_steps=6"]
  one_process(tmp_path / "straight", *flags)
  as_at_checkpoint(tmp_path / "straight", tmp_path / "one_then_two", 3)
  second = two_processes(tmp_path / "one_then_two", *flags)[1]
  two_processes(tmp_path / "two_then_one", *flags, "--config.trainer.num_train_steps=3")
  one_process(tmp_path / "two_then_one", *flags)
  expected = train_losses(tmp_path / "straight")
  for run in ("one_then_two", "two_then_one"):
    got = train_losses(tmp_path / run)
    assert sorted(got) == [1, 2, 3, 4, 5, 6], run  # Process 0 alone writes metrics: once each.
    for step in expected:
      assert got[step] == pytest.approx(expected[step], abs=1e-5), (run, step)
    # The same eval set however many processes hold its shares.
    assert sorted(eval_losses(tmp_path / run)) == [3, 6], run
    assert eval_losses(tmp_path / run) == pytest.approx(eval_losses(tmp_path / "straight"),
                                                        abs=1e-5), run
    assert [m["run/started_at_step"] for m in read_metrics(tmp_path / run)
            if "run/started_at_step" in m] == [0, 3]
  assert "logging_writer" not in second and "Finished in" not in second  # Process 1 is quiet.


def corrupt_files_of_process_1(checkpoint: pathlib.Path) -> list[pathlib.Path]:
  """Truncates the array data that process 1 wrote: only it reads them back under ZeRO-3."""
  files = [p for p in checkpoint.glob("state/ocdbt.process_1/d/*") if p.is_file()]
  for path in files:
    path.write_bytes(path.read_bytes()[:10])
  return files


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_zero3_on_two_processes_trains_like_one_and_both_agree_on_a_damaged_checkpoint(
    data_cache, tmp_path):
  flags = [f"--config.data.cache_dir={data_cache}", "--config.trainer.device_mesh.data=4",
           "--config.sharding.parameter_axis=data", "--config.checkpoint.every_steps=2",
           "--config.trainer.num_train_steps=4"]
  two_processes(tmp_path / "two", *flags)
  one_process(tmp_path / "one", *flags)
  two, one = train_losses(tmp_path / "two"), train_losses(tmp_path / "one")
  assert sorted(two) == [1, 2, 3, 4]
  for step in one:
    assert two[step] == pytest.approx(one[step], abs=1e-5), step
  checkpoints = tmp_path / "two" / "checkpoints"
  assert corrupt_files_of_process_1(checkpoints / "4")
  # Process 0 alone could restore step 4; both must resume from step 2, together.
  two_processes(tmp_path / "two", *flags, "--config.trainer.num_train_steps=5")
  assert {p.name for p in checkpoints.iterdir()} == {"2", "4", "4.unreadable", "5"}
  assert [m["run/started_at_step"] for m in read_metrics(tmp_path / "two")
          if "run/started_at_step" in m] == [0, 2]


def last_line(process: subprocess.Popen) -> str:
  _, stderr = process.communicate(timeout=120)
  assert process.returncode == 1, stderr[-3000:]
  return stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_an_unreachable_coordinator_is_named(tmp_path):
  address = free_address()  # Nothing listens there.
  line = last_line(start(tmp_path, 2, coordinator_address=address, num_processes=2, process_id=1,
                         initialization_timeout_seconds=3))
  assert line == (f"levanter_flax: error: cannot reach the coordinator at {address} (process 0) "
                  f"within 3 s (config.trainer.distributed.initialization_timeout_seconds): "
                  f"Connection refused")


def test_processes_that_never_all_arrive_end_the_run(tmp_path):
  address = free_address()
  line = last_line(start(tmp_path, 2, coordinator_address=address, num_processes=3, process_id=0,
                         initialization_timeout_seconds=3))
  assert line == (f"levanter_flax: error: not every process joined the coordinator at {address} "
                  f"as process 0 of 3 within 3 s (config.trainer.distributed."
                  f"initialization_timeout_seconds); check that all processes were started, with "
                  f"the same num_processes and distinct process_ids")


def test_a_process_id_beyond_the_process_count_is_refused(tmp_path):
  line = last_line(start(tmp_path, 2, coordinator_address=free_address(), num_processes=2,
                         process_id=2))
  assert line == ("levanter_flax: error: config.trainer.distributed.process_id must be in [0, 2) "
                  "for num_processes=2; got 2")


# Process 1 is slower by this much per step, and the runs are long enough for a signal to land.
SKEWED = dict(module="skewed_main", env={"SKEW_SECONDS": "0.1", "PYTHONPATH": str(REPO / "tests")})
SKEWED_FLAGS = ["--config.trainer.num_train_steps=40", "--config.checkpoint.every_steps=1000",
                "--config.trainer.eval_every_steps=1000"]


def saves(saves_dir: pathlib.Path) -> list[list[str]]:
  """What each process saved, as `skewed_main` lists it."""
  return [(saves_dir / f"process_{i}.txt").read_text().split("\n")[:-1] for i in range(2)]


@pytest.fixture(scope="module")
def uninterrupted_skewed_run(data_cache, tmp_path_factory) -> pathlib.Path:
  """40 steps on 2 processes that drift apart, with a checkpoint due every 0.1 s."""
  workdir = tmp_path_factory.mktemp("uninterrupted")
  env = {**SKEWED["env"], "SAVES_DIR": str(workdir)}
  finish(*start_two(workdir, f"--config.data.cache_dir={data_cache}", *SKEWED_FLAGS,
                    "--config.checkpoint.every_minutes=0.0017", module=SKEWED["module"],
                    env=env))
  return workdir


@pytest.mark.slow
def test_time_based_checkpoints_are_the_same_on_every_process(uninterrupted_skewed_run):
  on_0, on_1 = saves(uninterrupted_skewed_run)
  assert on_0 == on_1  # Process 0's clock decided for both; orbax would hang otherwise.
  assert sum(line.endswith(" time") for line in on_0) >= 3, on_0
  assert on_0[-1] == "40 step"
  # Each temporary one was deleted once a newer one was written.
  assert [p.name for p in (uninterrupted_skewed_run / "checkpoints").iterdir()] == ["40"]


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_after_the_same_step(data_cache, tmp_path,
                                                               uninterrupted_skewed_run):
  flags = [f"--config.data.cache_dir={data_cache}", *SKEWED_FLAGS]
  env = {**SKEWED["env"], "SAVES_DIR": str(tmp_path)}
  processes = start_two(tmp_path, *flags, module=SKEWED["module"], env=env)
  deadline = time.time() + 240
  while time.time() < deadline and not ((tmp_path / "metrics.jsonl").exists()
                                        and len(train_losses(tmp_path)) >= 3):
    time.sleep(0.2)
  processes[1].send_signal(signal.SIGTERM)  # A scheduler preempting one host.
  finish(*processes)
  stopped_at = max(train_losses(tmp_path))
  assert stopped_at < 40
  assert saves(tmp_path) == [[f"{stopped_at} step"]] * 2
  assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [str(stopped_at)]
  finish(*start_two(tmp_path, *flags, module=SKEWED["module"], env=env))
  expected, got = train_losses(uninterrupted_skewed_run), train_losses(tmp_path)
  assert sorted(got) == list(range(1, 41))
  assert all(got[step] == expected[step] for step in got), (got, expected)  # Bit for bit.


@pytest.mark.slow
def test_a_job_whose_workdir_is_held_stops_on_every_process(data_cache, tmp_path):
  holder = start(tmp_path, 2, f"--config.data.cache_dir={data_cache}",
                 "--config.trainer.num_train_steps=100000")
  deadline = time.time() + 240
  while time.time() < deadline and holder.poll() is None and not (
      (tmp_path / "metrics.jsonl").exists() and train_losses(tmp_path)):
    time.sleep(0.5)
  address = free_address()
  job = [start(tmp_path, 2, f"--config.data.cache_dir={data_cache}", coordinator_address=address,
               num_processes=2, process_id=i) for i in range(2)]
  lines = [last_line(p) for p in job]
  holder.kill()
  holder.wait()
  assert lines[0].startswith(f"levanter_flax: error: workdir {tmp_path} is in use by pid "
                             f"{holder.pid} on "), lines[0]
  assert lines[1] == (f"levanter_flax: error: workdir {tmp_path} is in use by another run; "
                      f"process 0's log names it")
