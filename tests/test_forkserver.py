"""tests/forkserver.py: a forked child behaves as the child `subprocess` starts would."""
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

import forkserver
from conftest import REPO

# What a child can tell of how it was started, which a forked and a started child must print
# alike; then whether it was forked, from the server's imports.
PROBE = """\
import os, sys
import levanter_flax  # As every command does: the environment it sets is then the same.
print(repr(sys.argv))
print(os.getcwd())
print(repr(sys.path[0]))
print(__name__, repr(globals().get("__file__")))
print(os.environ.get("XLA_FLAGS"), os.environ.get("TF_CPP_MIN_LOG_LEVEL"))
print(sys.stdin.read().upper())
print("to stderr", file=sys.stderr)
print("tensorflow" in sys.modules)
sys.exit(int(sys.argv[-1]))
"""
IS_FORKED = "import sys; print('tensorflow' in sys.modules)"


def preloaded(result: subprocess.CompletedProcess) -> bool:
  return result.stdout.splitlines()[-1] == "True"


@pytest.fixture
def probe(tmp_path) -> pathlib.Path:
  package = tmp_path / "probes"
  package.mkdir()
  (package / "probe.py").write_text(PROBE)
  return package / "probe.py"


@pytest.mark.parametrize("how", ["-m", "-c", "script"])
def test_a_forked_child_sees_what_a_started_one_would(probe, how):
  args = {"-m": ["-m", "probe"], "-c": ["-c", PROBE], "script": [str(probe)]}[how]
  env = {**os.environ, "XLA_FLAGS": "--xla_dump_to=/dev/null"}  # Read after import: forked.
  runs = [module.run([sys.executable, *args, "two words", "3"], cwd=probe.parent, env=env,
                     input="from stdin", capture_output=True, text=True, timeout=120)
          for module in (subprocess, forkserver)]
  started, forked = runs
  assert preloaded(forked) and not preloaded(started)
  assert forked.returncode == started.returncode == 3
  assert forked.stdout.splitlines()[:-1] == started.stdout.splitlines()[:-1]
  assert forked.stderr == started.stderr == "to stderr\n"


def test_an_uncaught_exception_exits_1_with_its_traceback():
  result = forkserver.run([sys.executable, "-c", "raise ValueError('the culprit')"],
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 1
  assert result.stderr.rstrip().endswith("ValueError: the culprit")


# How a program can end, each to be ended by a forked child as by a started one.
ENDINGS = {
    "sys.exit(message)": "import sys; print('out'); sys.exit('the culprit')",
    "threads and atexit": (
        "import atexit, sys, threading, time\n"
        "atexit.register(lambda: print('atexit, after the thread', flush=False))\n"
        "threading.Thread(target=lambda: (time.sleep(0.3), print('thread'))).start()\n"
        "print('unflushed', end='', file=sys.stderr)\n"
        "sys.exit(4)"),
    "KeyboardInterrupt": "print('before'); raise KeyboardInterrupt",
    "exit(None) after output": "import sys; sys.stdout.write('x' * 100000); sys.exit(None)",
}


@pytest.mark.parametrize("ending", sorted(ENDINGS))
def test_a_forked_child_ends_as_a_started_one(ending):
  runs = [module.run([sys.executable, "-c", f"{IS_FORKED}\n{ENDINGS[ending]}"], cwd=REPO,
                     capture_output=True, text=True, timeout=120)
          for module in (subprocess, forkserver)]
  started, forked = runs
  assert forked.stdout.startswith("True\n") and started.stdout.startswith("False\n")
  assert (forked.returncode, forked.stdout[5:], forked.stderr) == (
      started.returncode, started.stdout[6:], started.stderr)


def test_signals_wait_and_poll_reach_the_forked_child():
  child = forkserver.Popen([sys.executable, "-c", "import time; print('up', flush=True); "
                            "time.sleep(300)"], stdout=subprocess.PIPE, text=True,
                           start_new_session=True)
  assert child.stdout.readline() == "up\n"
  assert child.poll() is None
  assert os.getsid(child.pid) == child.pid
  with pytest.raises(subprocess.TimeoutExpired):
    child.wait(timeout=0.2)
  child.send_signal(signal.SIGTERM)
  assert child.wait(timeout=60) == -signal.SIGTERM
  child.stdout.close()
  with pytest.raises(subprocess.TimeoutExpired):
    forkserver.run([sys.executable, "-c", "import time; time.sleep(300)"], timeout=0.5)


def test_stderr_into_stdout_and_devnull():
  merged = forkserver.run([sys.executable, "-c", "import sys; print('out', flush=True); "
                           "print('err', file=sys.stderr)"], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=120)
  assert merged.stdout == "out\nerr\n"
  quiet = forkserver.run([sys.executable, "-c", "print('nothing')"], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, timeout=120)
  assert quiet.returncode == 0 and quiet.stdout is None


def test_what_the_imports_saw_decides_between_forking_and_starting():
  # XLA_FLAGS is read when a backend starts: forked. JAX_PLATFORMS is read when jax is imported:
  # started afresh, and so is a child without it.
  flags = forkserver.run([sys.executable, "-c", IS_FORKED], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "XLA_FLAGS": "--xla_dump_to=/dev/null"})
  assert preloaded(flags)
  platforms = forkserver.run([sys.executable, "-c", IS_FORKED], capture_output=True, text=True,
                             timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu,tpu"})
  assert not preloaded(platforms)
  # Running a module the server imported as __main__ would leave two copies of it.
  python = sys.executable
  assert forkserver.how_to_run([python, "-m", "levanter_flax.commands.api"], None, REPO) is None
  assert forkserver.how_to_run([python, "-m", "levanter_flax.main"], None, REPO) is not None
  assert forkserver.how_to_run([python, "-u", "-m", "levanter_flax.main"], None, REPO) is None
  assert forkserver.how_to_run([python, "-c", "pass"], None, REPO / "no-such-dir") is None


def test_a_missing_directory_or_script_fails_as_subprocess_does(tmp_path):
  for module in (subprocess, forkserver):
    with pytest.raises(FileNotFoundError):
      module.run([sys.executable, "-c", "pass"], cwd=tmp_path / "gone")
  missing = forkserver.run([sys.executable, "no_such_script.py"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
  assert missing.returncode == 2 and "No such file or directory" in missing.stderr


def test_many_children_at_once_each_get_their_own_exit_code():
  children = [forkserver.Popen([sys.executable, "-c", f"import sys; sys.exit({i})"])
              for i in range(8)]
  deadline = time.monotonic() + 120
  assert [child.wait(timeout=deadline - time.monotonic()) for child in children] == list(range(8))
