"""Several processes joined by jax.distributed (gloo on 127.0.0.1) train as one process does."""
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import REPO, read_metrics, train_losses
from test_main import NANO, TINY

STEPS = ["--config.trainer.batch_size=8", "--config.trainer.num_train_steps=5",
         "--config.trainer.eval_every_steps=5", "--config.trainer.checkpoint_every_steps=5"]


def free_address() -> str:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return f"127.0.0.1:{s.getsockname()[1]}"


def start(workdir, devices: int, *flags, **distributed) -> subprocess.Popen:
  env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
  extra = [f"--config.trainer.distributed.{k}={v}" for k, v in distributed.items()]
  return subprocess.Popen([sys.executable, "-m", "levanter_flax.main", f"--config={NANO}",
                           f"--workdir={workdir}", *TINY, *STEPS, *flags, *extra], cwd=REPO,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(*processes: subprocess.Popen) -> list[str]:
  """Each process's stderr, once all have exited 0."""
  outputs = [p.communicate(timeout=300)[1] for p in processes]
  for process, stderr in zip(processes, outputs):
    assert process.returncode == 0, stderr[-3000:]
  return outputs


def two_processes(workdir, *flags) -> list[str]:
  address = free_address()
  return finish(*(start(workdir, 2, *flags, coordinator_address=address, num_processes=2,
                        process_id=i) for i in range(2)))


def one_process(workdir, *flags) -> str:
  return finish(start(workdir, 4, "--config.data.reader_groups=2", *flags))[0]


@pytest.mark.parametrize("sharding", [["--config.trainer.device_mesh.data=4"],
                                      ["--config.trainer.device_mesh.data=4",
                                       "--config.sharding.parameter_axis=data"]],
                         ids=["data4", "zero3"])
def test_two_processes_train_like_one_process_with_four_devices(data_cache, tmp_path, sharding):
  flags = [f"--config.data.cache_dir={data_cache}", *sharding]
  _, second = two_processes(tmp_path / "two", *flags)
  one_process(tmp_path / "one", *flags)
  two, one = train_losses(tmp_path / "two"), train_losses(tmp_path / "one")
  assert sorted(two) == [1, 2, 3, 4, 5]  # Process 0 alone writes metrics: each step once.
  for step in one:
    assert two[step] == pytest.approx(one[step], abs=1e-5), step
  assert "logging_writer" not in second and "Finished in" not in second  # Process 1 is quiet.
  if "--config.sharding.parameter_axis=data" in sharding:
    return
  # The 2-process checkpoint resumes in one process, as the 1-process one does.
  for workdir in ("two", "one"):
    one_process(tmp_path / workdir, *flags, "--config.trainer.num_train_steps=7")
  resumed_two, resumed_one = train_losses(tmp_path / "two"), train_losses(tmp_path / "one")
  for step in (6, 7):
    assert resumed_two[step] == pytest.approx(resumed_one[step], abs=1e-5), step
  assert [m["run/started_at_step"] for m in read_metrics(tmp_path / "two")
          if "run/started_at_step" in m] == [0, 5]


def last_line(process: subprocess.Popen) -> str:
  _, stderr = process.communicate(timeout=120)
  assert process.returncode == 1, stderr[-3000:]
  return stderr.strip().splitlines()[-1]


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


def test_sigterm_to_one_process_stops_both_after_the_same_step(data_cache, tmp_path):
  address = free_address()
  processes = [start(tmp_path, 2, f"--config.data.cache_dir={data_cache}",
                     "--config.trainer.num_train_steps=100000",
                     "--config.trainer.checkpoint_every_steps=1000", coordinator_address=address,
                     num_processes=2, process_id=i) for i in range(2)]
  deadline = time.time() + 240
  while time.time() < deadline and not ((tmp_path / "metrics.jsonl").exists()
                                        and len(train_losses(tmp_path)) >= 3):
    time.sleep(0.5)
  processes[1].send_signal(signal.SIGTERM)  # A scheduler preempting one host.
  finish(*processes)
  stopped_at = max(train_losses(tmp_path))
  assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == [stopped_at]


def corrupt_files_of_process_1(checkpoint: pathlib.Path) -> list[pathlib.Path]:
  """Truncates the array data that process 1 wrote: only it reads them back under ZeRO-3."""
  files = [p for p in checkpoint.glob("state/ocdbt.process_1/d/*") if p.is_file()]
  for path in files:
    path.write_bytes(path.read_bytes()[:10])
  return files


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_processes_agree_that_a_checkpoint_one_of_them_cannot_read_is_damaged(data_cache, tmp_path):
  flags = [f"--config.data.cache_dir={data_cache}", "--config.trainer.device_mesh.data=4",
           "--config.sharding.parameter_axis=data", "--config.trainer.checkpoint_every_steps=2",
           "--config.trainer.num_train_steps=4"]
  two_processes(tmp_path, *flags)
  assert corrupt_files_of_process_1(tmp_path / "checkpoints" / "4")
  # Process 0 alone could restore step 4; both must resume from step 2, together.
  two_processes(tmp_path, *flags, "--config.trainer.num_train_steps=5")
  assert {p.name for p in (tmp_path / "checkpoints").iterdir()} == {"2", "4", "4.unreadable", "5"}
  assert [m["run/started_at_step"] for m in read_metrics(tmp_path)
          if "run/started_at_step" in m] == [0, 2]


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
