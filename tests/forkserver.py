"""A fork server for the tests' Python subprocesses: `forkserver.run` and `forkserver.Popen` are
`subprocess.run` and `subprocess.Popen` whose `python -m MODULE`, `python -c CODE` and
`python SCRIPT` children are forked from a process that has already imported jax, flax,
TensorFlow and the trainer, rather than started afresh.

Why: about 200 tests run the commands as users do, in a process of their own, and each such
process spends 5 to 7 s of its 9 to 12 s importing. A forked child starts with those imports done.

What a child sees is what a started one would: its own pid, stdio, working directory,
environment, argv, `sys.path[0]` and `__main__`; its exit code and signals reach `Popen`'s
`wait`, `poll`, `send_signal`, `kill` and `returncode`. A child is forked only where that holds:
anything else (an option before -m, a preexec_fn, an environment that differs in a variable read
at import, `-m` of a module the server has imported, ...) runs as `subprocess` would run it.
Two differences remain. A child finds the state the preloaded imports leave, as every command
does, but so does a `-c` snippet that imports less (orbax's import gives the root logger a
handler, so such a snippet's `logging.basicConfig` needs `force=True`). And a child ends as the
interpreter ends a program (threads joined, atexit handlers run, stdio flushed, the same exit
code) without then tearing down its modules, 1.3 s of every child's time: a file the program
left open and unflushed is not flushed by its garbage collection, as the trainer never relies on.

Each pytest worker starts its own server on first use. The server never initializes a jax backend
(forking one is unsafe), so XLA_FLAGS, read when a backend starts, may differ per child.
"""
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading

# Imported once by the server: what the commands import, jax and TensorFlow under them.
PRELOAD = ("levanter_flax.commands.api", "levanter_flax.data.loader",
           "levanter_flax.generate.export", "levanter_flax.generate.server",
           "levanter_flax.eval.tasks", "levanter_flax.monitoring.report", "tensorflow",
           "tensorflow_datasets")

# Read when a command runs, not when the preloaded modules are imported: a child may set them as
# it likes. Any other variable must be as the server had it, or the child is started, not forked.
READ_AFTER_IMPORT = frozenset({
    "XLA_FLAGS", "LEVANTER_FLAX_DEBUG", "PYTEST_CURRENT_TEST", "HOME", "NETRC",
    # Set in the tests' process by what it imports and runs (plan/slices.py, jax's Mosaic GPU),
    # read by libtpu and Mosaic when they start, which the CPU children never do.
    "ALLOW_MULTIPLE_LIBTPU_LOAD", "MOSAIC_GPU_CUDA_ROOT",
    # Google Cloud clients read these when they connect (tests/gcs_emulator.py sets them).
    "STORAGE_EMULATOR_HOST", "GOOGLE_AUTH_TOKEN_FOR_TESTING", "GOOGLE_CLOUD_PROJECT",
    "GOOGLE_APPLICATION_CREDENTIALS", "CURL_CA_BUNDLE", "NO_GCE_CHECK",
    "GCS_RETRY_CONFIG_MAX_RETRIES", "TENSORSTORE_GCS_HTTP_URL", "GCS_PROXY_LOG",
    "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy",
    # The tests' own knobs, read by tests/*_main.py.
    "TERM_AT", "SAVES_DIR", "KILL_AFTER_CHECKPOINT", "SPIKE_WINDOWS", "SKEW_SECONDS", "PAUSE_DIR",
    "INVALID_ARGUMENT",
})
READ_AFTER_IMPORT_PREFIXES = ("WANDB_",)

_session_environment: dict[str, str] | None = None


def record_session_environment() -> None:
  """The environment the server starts with: the session's, before any test patches it."""
  global _session_environment
  _session_environment = dict(os.environ)


# ---- The client: the test's side. ----

class _Server:
  """One running server: its socket, and what its imports set and loaded."""

  def __init__(self):
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    environment = dict(_session_environment if _session_environment is not None else os.environ)
    self.environment = environment
    self.process = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), str(theirs.fileno())],
        pass_fds=(theirs.fileno(),), cwd="/", env=environment, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    theirs.close()
    self.socket = ours
    hello = ours.recv(1 << 22)
    if not hello:
      raise RuntimeError("tests/forkserver.py: the server exited while importing; run "
                         f"`python tests/forkserver.py` to see why")
    hello = pickle.loads(hello)
    self.modules = frozenset(hello["modules"])
    self.import_set = hello["import_set"]
    self.lock = threading.Lock()

  def admits(self, env: dict[str, str]) -> bool:
    """Whether a child with environment `env` sees what the server's imports saw."""
    expected = {**self.environment, **self.import_set}
    for key in expected.keys() | env.keys():
      if key in READ_AFTER_IMPORT or key.startswith(READ_AFTER_IMPORT_PREFIXES):
        continue
      if key not in env and key in self.import_set:
        continue  # The child's own imports would set it; the server's did.
      if key == "PYTHONPATH":
        if not _extends(expected.get(key, ""), env.get(key, "")):
          return False
        continue
      if env.get(key) != expected.get(key):
        return False
    return True

  def start(self, request: dict, fds: list[int]) -> int:
    """Sends a request; returns the read end of the child's status pipe."""
    status_read, status_write = os.pipe()
    try:
      with self.lock:
        socket.send_fds(self.socket, [pickle.dumps(request)], [*fds, status_write])
    finally:
      os.close(status_write)
    return status_read


def _extends(base: str, extended: str) -> bool:
  """Whether PYTHONPATH `extended` is `base` with entries added in front."""
  base_entries = [e for e in base.split(os.pathsep) if e]
  entries = [e for e in extended.split(os.pathsep) if e]
  return entries[len(entries) - len(base_entries):] == base_entries if base_entries else True


_server: _Server | None = None
_server_lock = threading.Lock()


def _the_server() -> _Server:
  global _server
  with _server_lock:
    if _server is None or _server.process.poll() is not None:
      _server = _Server()
    return _server


def how_to_run(args, env, cwd) -> dict | None:
  """The request that forks `args`, or None where only starting it is faithful."""
  if isinstance(args, (str, bytes, os.PathLike)) or len(args) < 2:
    return None
  args = [os.fspath(a) for a in args]
  if any(not isinstance(a, str) for a in args) or args[0] != sys.executable:
    return None
  cwd = os.fspath(cwd) if cwd is not None else os.getcwd()
  if not os.path.isdir(cwd):
    return None
  if args[1] in ("-m", "-c"):
    if len(args) < 3:
      return None
    mode, target, argv = args[1], args[2], args[3:]
  elif args[1].startswith("-"):
    return None
  else:
    mode, target, argv = "script", args[1], args[2:]
  server = _the_server()
  env = dict(os.environ if env is None else env)
  if not server.admits(env):
    return None
  if mode == "-m" and (target in server.modules or f"{target}.__main__" in server.modules):
    return None  # Running it as __main__ would execute a second copy beside the imported one.
  if mode == "script" and not os.path.isfile(os.path.join(cwd, target)):
    return None
  extra_path = [e for e in env.get("PYTHONPATH", "").split(os.pathsep) if e]
  base_path = [e for e in server.environment.get("PYTHONPATH", "").split(os.pathsep) if e]
  return {"mode": mode, "target": target, "argv": argv, "cwd": cwd, "env": env,
          "extra_path": extra_path[:len(extra_path) - len(base_path)]}


class Popen(subprocess.Popen):
  """subprocess.Popen, forking Python children from the server where that is faithful."""

  _status_fd = None

  def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                     startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite,
                     errread, errwrite, restore_signals, gid, gids, uid, umask,
                     start_new_session, process_group):
    request = None
    if (executable is None and preexec_fn is None and not pass_fds and not shell
        and restore_signals and gid is None and not gids and uid is None and umask < 0
        and process_group in (None, -1)):
      request = how_to_run(args, env, cwd)
    if request is None:
      return super()._execute_child(
          args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
          creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
          restore_signals, gid, gids, uid, umask, start_new_session, process_group)
    request["new_session"] = bool(start_new_session)
    stdio = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1,
             errwrite if errwrite != -1 else 2]
    self._status_fd = _the_server().start(request, stdio)
    self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
    line = _read_line(self._status_fd)
    if not line:
      raise RuntimeError(f"tests/forkserver.py: the server failed to fork {args!r}")
    self.pid = int(line)
    self._child_created = True

  def _exit_code(self, block: bool):
    """Reads the nanny's report of the child's exit, if there is one yet."""
    if not block and not select.select([self._status_fd], [], [], 0)[0]:
      return None
    line = _read_line(self._status_fd)
    os.close(self._status_fd)
    self._status_fd = None
    # The nanny reports every exit; silence means the server and nanny died with it.
    return int(line) if line else -signal.SIGKILL

  def _internal_poll(self, _deadstate=None, **_):
    if self._status_fd is None:
      return super()._internal_poll(_deadstate)
    if self.returncode is None and self._waitpid_lock.acquire(False):
      try:
        if self.returncode is None and self._status_fd is not None:
          self.returncode = self._exit_code(block=False)
      finally:
        self._waitpid_lock.release()
    return self.returncode

  def _wait(self, timeout):
    if self._status_fd is None:
      return super()._wait(timeout)
    if self.returncode is not None:
      return self.returncode
    with self._waitpid_lock:
      if self.returncode is None:
        if timeout is not None and not select.select([self._status_fd], [], [], timeout)[0]:
          raise subprocess.TimeoutExpired(self.args, timeout)
        self.returncode = self._exit_code(block=True)
    return self.returncode


def _read_line(fd: int) -> str:
  data = b""
  while not data.endswith(b"\n"):
    chunk = os.read(fd, 64)
    if not chunk:
      break
    data += chunk
  return data.decode().strip()


def run(*popenargs, input=None, capture_output=False, timeout=None, check=False,  # pylint: disable=redefined-builtin
        **kwargs) -> subprocess.CompletedProcess:
  """subprocess.run, on this module's Popen."""
  if input is not None:
    kwargs["stdin"] = subprocess.PIPE
  if capture_output:
    kwargs["stdout"] = subprocess.PIPE
    kwargs["stderr"] = subprocess.PIPE
  with Popen(*popenargs, **kwargs) as process:
    try:
      stdout, stderr = process.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired as timed_out:
      process.kill()
      timed_out.output, timed_out.stderr = process.communicate()
      raise
    except:
      process.kill()
      raise
    code = process.poll()
    if check and code:
      raise subprocess.CalledProcessError(code, process.args, output=stdout, stderr=stderr)
  return subprocess.CompletedProcess(process.args, code, stdout, stderr)


# ---- The server. ----

def _serve(channel: socket.socket) -> dict:
  """Answers requests until the client goes; in a forked child, returns that child's request."""
  signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # Nannies are reaped by the kernel.
  while True:
    try:
      message, fds, _, _ = socket.recv_fds(channel, 1 << 24, 4)
    except ConnectionResetError:
      message = b""
    if not message:
      sys.exit(0)
    if os.fork() == 0:
      channel.close()
      signal.signal(signal.SIGCHLD, signal.SIG_DFL)
      return _nanny(pickle.loads(message), fds)
    for fd in fds:
      os.close(fd)


def _nanny(request: dict, fds: list[int]) -> dict:
  """Forks the child; reports its pid, then its exit code, on the status pipe."""
  *stdio, status = fds
  child = os.fork()
  if child == 0:
    os.close(status)
    request["stdio"] = stdio
    return request
  for fd in stdio:
    os.close(fd)
  os.write(status, f"{child}\n".encode())
  _, wait_status = os.waitpid(child, 0)
  os.write(status, f"{os.waitstatus_to_exitcode(wait_status)}\n".encode())
  os._exit(0)  # pylint: disable=protected-access


def _become(request: dict) -> None:
  """Makes this forked process what `python MODE TARGET ARGV` started there would be."""
  for target_fd, fd in enumerate(request["stdio"]):
    os.dup2(fd, target_fd)
  for fd in set(request["stdio"]) - {0, 1, 2}:
    os.close(fd)
  if request["new_session"]:
    os.setsid()
  os.chdir(request["cwd"])
  os.environ.clear()
  os.environ.update(request["env"])
  for key, value in _import_set.items():
    os.environ.setdefault(key, value)
  if "PYTHONUNBUFFERED" in request["env"]:
    sys.stdout.reconfigure(write_through=True)
    sys.stderr.reconfigure(write_through=True)
  mode, target = request["mode"], request["target"]
  if mode == "-m":
    first = os.getcwd()
  elif mode == "-c":
    first = ""
  else:
    first = os.path.dirname(os.path.realpath(os.path.join(request["cwd"], target)))
  sys.path[:] = [first, *request["extra_path"], *_path_after_first]
  import types  # pylint: disable=g-import-not-at-top
  main = types.ModuleType("__main__")
  main.__dict__["__builtins__"] = __builtins__
  sys.modules["__main__"] = main
  sys.argv = [{"-m": "-m", "-c": "-c"}.get(mode, target), *request["argv"]]


def _run(request: dict) -> None:
  """Runs the child's program in `__main__`, as the interpreter would."""
  mode, target = request["mode"], request["target"]
  if mode == "-m":
    import runpy  # pylint: disable=g-import-not-at-top
    runpy._run_module_as_main(target, alter_argv=True)  # pylint: disable=protected-access
    return
  main = sys.modules["__main__"]
  if mode == "-c":
    code = compile(target, "<string>", "exec")
  else:
    path = os.path.abspath(target)
    main.__dict__.update(__file__=path, __cached__=None)
    with open(path, "rb") as source:
      code = compile(source.read(), path, "exec")
  exec(code, main.__dict__)  # pylint: disable=exec-used


_import_set: dict[str, str] = {}  # What the server's imports put in its environment.
_path_after_first: list[str] = []


def _server_main(fd: int) -> None:
  channel = socket.socket(fileno=fd)
  environment_at_start = dict(os.environ)
  _path_after_first.extend(sys.path[1:])
  import importlib  # pylint: disable=g-import-not-at-top
  for name in PRELOAD:
    importlib.import_module(name)
  modules = sorted(sys.modules)
  _import_set.update({k: v for k, v in os.environ.items() if environment_at_start.get(k) != v})
  channel.send(pickle.dumps({"modules": modules, "import_set": _import_set}))
  request = _serve(channel)
  _become(request)
  _exit(_exit_code_of(request))


def _exit_code_of(request: dict) -> int:
  """Runs the child's program; its exit code, by the interpreter's rules for what it raised."""
  try:
    _run(request)
  except SystemExit as stop:
    if stop.code is None or isinstance(stop.code, int):
      return stop.code or 0
    print(stop.code, file=sys.stderr)
    return 1
  except BaseException as error:  # pylint: disable=broad-exception-caught
    error.__traceback__ = _program_frames(error.__traceback__)  # The default hook prints this one.
    sys.excepthook(type(error), error, error.__traceback__)
    return _INTERRUPTED if isinstance(error, KeyboardInterrupt) else 1
  return 0


_INTERRUPTED = -signal.SIGINT


def _program_frames(traceback):
  """A traceback without this module's frames, as a started program's shows none."""
  while traceback is not None and traceback.tb_frame.f_code.co_filename == _run.__code__.co_filename:
    traceback = traceback.tb_next
  return traceback


def _exit(code: int) -> None:
  """Ends the child as the interpreter's shutdown would (non-daemon threads joined, atexit
  handlers run, stdio flushed, an interrupted one killed by SIGINT), but without tearing down its
  modules: with TensorFlow, jax and torch imported that takes 1.3 s, most of a short command's
  time after its imports, and what it does (module globals dropped, the objects they held
  collected) nothing the trainer relies on."""
  import atexit  # pylint: disable=g-import-not-at-top
  threading._shutdown()  # pylint: disable=protected-access
  atexit._run_exitfuncs()  # pylint: disable=protected-access
  for stream in (sys.stdout, sys.stderr):
    if stream is None or stream.closed:
      continue
    try:
      stream.flush()
    except OSError:
      if stream is sys.stdout:
        code = 120  # As Python exits when stdout cannot be flushed.
  if code == _INTERRUPTED:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
  os._exit(code)  # pylint: disable=protected-access


if __name__ == "__main__":
  _server_main(int(sys.argv[1]))
