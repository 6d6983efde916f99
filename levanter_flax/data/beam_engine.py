"""prepare's shards written by an Apache Beam pipeline: local, Dataflow, Flink or Spark.

The pipeline runs prepare's own functions on one element per shard index, so
its shards, done markers and manifest are the bytes the local engine writes;
Beam spreads the shards over workers and retries failed ones:

  shard indices -> write each shard (or read back its done marker) -> combine -> manifest
  [with --train_tokenizer: shard indices -> each part's sample -> combine -> train BPE,
   a side input of the shard writers]

A run that dies is rerun as a whole: shards whose done marker exists are kept,
and the manifest, the mark of a usable dataset, is written last, by the
combine. Apache Beam is an optional install (the [beam] extra).
"""
import contextlib
import functools
import io
import logging as std_logging
import os
import queue
import re
import select
import sys
import threading
import time

from absl import logging

from levanter_flax.core import paths
from levanter_flax.data import shards, sources
from levanter_flax.core.errors import UserError

# The local runner; without --runner Beam 2.77's DirectRunner first downloads Prism.
DEFAULT_RUNNER = "FnApiRunner"
# Runner classes (whatever name chose them: "direct", "DirectRunner", a module path) that
# run here, as Beam's StandardOptions.LOCAL_RUNNERS lists them.
LOCAL_RUNNERS = ("BundleBasedDirectRunner", "DirectRunner", "SwitchingDirectRunner", "FnApiRunner",
                 "PrismRunner", "TestDirectRunner")
_INSTALL = 'pip install "levanter_flax[beam]" (add apache-beam[gcp] for Dataflow)'


def _import_beam():
  try:
    import apache_beam  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise UserError(f"--engine=beam needs Apache Beam: {_INSTALL}") from None
  return apache_beam


def pipeline(options: shards.PrepareOptions, num_files: int):
  """A Beam pipeline configured by --beam_pipeline_options; bad options are named in one line.

  The local runner gets num_workers worker processes (with one, it runs in
  this process); a remote one must be able to reach every path.
  """
  beam = _import_beam()
  from apache_beam.options import pipeline_options as beam_options  # pylint: disable=g-import-not-at-top
  flags = list(options.beam_pipeline_options)
  argparse_says = io.StringIO()
  try:
    with contextlib.redirect_stderr(argparse_says):  # Its usage: every option Beam has.
      parsed = beam_options.PipelineOptions(flags)
      known = parsed.get_all_options()
      unknown = sorted(set(parsed.get_all_options(retain_unknown_options=True)) - set(known))
  except (SystemExit, ValueError, TypeError) as e:  # argparse exits on a bad value.
    reason = (argparse_says.getvalue().strip().splitlines() or [str(e)])[-1].split("error: ")[-1]
    raise UserError(f"--beam_pipeline_options={' '.join(flags)!r}: {reason}") from None
  if unknown:
    raise UserError(f"--beam_pipeline_options: unknown Beam option(s) --{', --'.join(unknown)}")
  runner = known.get("runner") or DEFAULT_RUNNER
  try:
    local = is_local(beam.runners.create_runner(runner))
  except (ValueError, ImportError, AttributeError) as e:
    raise UserError(f"--beam_pipeline_options: runner {runner!r}: {e}") from None
  overrides = {"runner": runner}
  if local and not any(f.startswith("--direct_") for f in flags):
    workers = min(options.num_workers, options.num_shards)
    overrides |= {"direct_num_workers": workers,
                  "direct_running_mode": "multi_processing" if workers > 1 else "in_memory"}
  if not local:
    _check_remote_job(options, num_files, runner)
  try:
    # Dataflow checks its options here, and may look for its default staging bucket.
    return beam.Pipeline(options=beam_options.PipelineOptions(flags, **overrides))
  except Exception as e:  # pylint: disable=broad-except  # Each runner raises its own.
    raise UserError(f"--beam_pipeline_options: runner {runner!r}: {_one_line(e)}") from None


def is_local(runner) -> bool:
  """Whether a Beam runner object runs the pipeline in this machine's processes."""
  return type(runner).__name__ in LOCAL_RUNNERS


def _one_line(error: Exception, limit: int = 600) -> str:
  """An exception's text on one line (Dataflow's list one problem a line), cut at `limit`."""
  text = " ".join(str(error).split()) or type(error).__name__
  return text if len(text) <= limit else text[:limit] + " ..."


def _check_remote_job(options: shards.PrepareOptions, num_files: int, runner: str) -> None:
  """A remote runner's workers see only object storage, and each should read its own files."""
  spec = options.source
  file_kinds = ("text", "jsonl", "parquet", *sources.RECORD_KINDS)
  if spec.kind in file_kinds and num_files < options.num_shards:
    raise UserError(f"{num_files} input files for --num_shards={options.num_shards}: with fewer "
                    f"files than shards every {runner} worker reads every file; use at most "
                    f"{num_files} shards or split the input")
  given = [("--output_dir", str(options.output_dir))]
  if spec.kind in file_kinds:
    given += [("--input", pattern) for pattern in spec.inputs]
  if spec.kind == "tfds":
    given.append(("--tfds_data_dir", spec.tfds_data_dir))
  if options.tokenizer != "byte":
    given.append(("--tokenizer", options.tokenizer))
  if options.chat_template:
    given.append(("--chat_template", options.chat_template))
  for flag, value in given:
    if not paths.is_remote(value):
      raise UserError(f"{flag}={value or '(default)'} is on this machine, which {runner}'s "
                      f"workers cannot see: use gs://")
  if spec.kind == "stdlib":
    raise UserError(f"the stdlib corpus is this machine's Python; {runner}'s workers have their "
                    f"own: prepare it locally (--engine=local)")


# Where a worker logs the traceback of a failed element.
_TRACEBACK_LOGGERS = ("apache_beam.runners.common", "apache_beam.runners.worker.sdk_worker")


@functools.cache
def _die_with(driver_pid: int) -> None:
  """Ends this local worker process when the driver ends, even by kill -9.

  Otherwise the workers of a killed prepare write on to the end of their
  bundles (hours, on a big corpus) for nobody. They are the driver's
  grandchildren (Beam starts them through a shell), so PR_SET_PDEATHSIG, which
  watches the parent, cannot tell; a pidfd watches the driver itself. Linux only.
  """
  try:
    driver = os.pidfd_open(driver_pid)
  except ProcessLookupError:
    os._exit(1)  # pylint: disable=protected-access
  except (AttributeError, OSError):
    return
  def wait_then_exit():
    select.select([driver], [], [])
    os._exit(1)  # pylint: disable=protected-access
  threading.Thread(target=wait_then_exit, daemon=True, name="die-with-driver").start()


def _step(function, local_driver_pid: int, *args):
  """Runs `function(*args)` on a worker; bad input fails the pipeline with its one line.

  A UserError fails every retry alike and stops the job; its line reaches the
  driver in the runner's exception (see run), so the worker's logged traceback
  is noise. A local runner's worker processes (children of `local_driver_pid`;
  0 on a remote runner) also print it to their stderr, which is ours.
  """
  local_worker = local_driver_pid and os.getpid() != local_driver_pid
  if local_worker:
    _die_with(local_driver_pid)
  try:
    return function(*args)
  except UserError:
    for name in _TRACEBACK_LOGGERS:
      std_logging.getLogger(name).setLevel(std_logging.CRITICAL)
    if local_worker:
      sys.stderr = open(os.devnull, "w", encoding="utf-8")  # pylint: disable=consider-using-with
    raise


def _sample(options, files: list[str], index: int) -> tuple[int, list[str]]:
  return index, shards.tokenizer_sample(options, files, index)


def _train(options, samples: list[tuple[int, list[str]]]) -> str:
  return shards.train_tokenizer(options, [texts for _, texts in sorted(samples)])


def _shard(options, files: list[str], index: int, tokenizer_spec: str) -> tuple[int, dict]:
  return index, shards.shard_record(options, files, tokenizer_spec, index)


def _manifest(options, num_files: int, records: list[tuple[int, dict]], tokenizer_spec: str) -> None:
  shards.write_manifest(options, num_files, tokenizer_spec, [r for _, r in sorted(records)])


def _build(pipeline, options, files: list[str], train_tokenizer: bool, local_driver_pid: int):
  beam = _import_beam()
  step = lambda function, *args: functools.partial(_step, function, local_driver_pid, *args)
  indices = range(options.num_shards)
  tokenizer_spec = shards.tokenizer_spec(options)
  if train_tokenizer:
    tokenizer_spec = beam.pvalue.AsSingleton(
        pipeline
        | "Parts" >> beam.Create(indices)
        | "Sample" >> beam.Map(step(_sample, options, files))
        | "Samples" >> beam.combiners.ToList()
        | "TrainTokenizer" >> beam.Map(step(_train, options)))
  _ = (pipeline
       | "Shards" >> beam.Create(indices)
       | "WriteShard" >> beam.Map(step(_shard, options, files), tokenizer_spec)
       | "DoneMarkers" >> beam.combiners.ToList()
       | "WriteManifest" >> beam.Map(step(_manifest, options, len(files)), tokenizer_spec))


# How a worker's UserError reaches this process: inside the text of the runner's exception.
_USER_ERROR = re.compile(r"UserError: (.+)$", re.MULTILINE)
_STEP_NAME = re.compile(r" \[while running '[^']*'\]")  # Beam's suffix.
# What Beam's local runner (local_job_service.SubprocessSdkWorker, 2.72-2.77) raises.
_WORKER_DIED = "Worker subprocess exited with return code"


class _WorkerDied(Exception):
  pass


def run(pipeline, options, files: list[str], train_tokenizer: bool) -> None:
  """Runs the pipeline to the end; a worker's UserError is raised here as one."""
  runner = pipeline.options.get_all_options()["runner"]
  local = is_local(pipeline.runner)
  _build(pipeline, options, files, train_tokenizer, os.getpid() if local else 0)
  logging.info("Running the Beam pipeline on %s", runner)
  try:
    with _quiet_beam_logs(local):
      _run_watched(pipeline, local)
  except UserError as e:  # From a step run in this process, its name appended by Beam.
    raise UserError(_STEP_NAME.sub("", str(e))) from None
  except _WorkerDied:
    raise UserError(f"a Beam worker process died (killed, or out of memory?) while writing "
                    f"{options.output_dir}; its finished shards are kept: run the same command "
                    f"again") from None
  except Exception as e:  # pylint: disable=broad-except  # Runners wrap a worker's error.
    if found := _USER_ERROR.findall(str(e)):
      raise UserError(_STEP_NAME.sub("", found[-1])) from None
    if local:
      raise
    # Submission (API off, no permission) or the job (FAILED, CANCELLED): say it in a line.
    raise UserError(f"the {runner} job for {options.output_dir} failed: {_one_line(e)}; "
                    f"finished shards are kept: run the same command again") from None


@contextlib.contextmanager
def _quiet_beam_logs(local: bool):
  """Beam's INFO lines drown ours; a local run's errors reach us in its exception.

  Dataflow's INFO lines (the job's URL, its state) stay.
  """
  levels = {"apache_beam": std_logging.WARNING, "apache_beam.runners.dataflow": std_logging.INFO}
  for name in ("apache_beam.runners.portability", "apache_beam.runners.worker",
               *_TRACEBACK_LOGGERS):
    levels[name] = std_logging.CRITICAL if local else std_logging.WARNING
  loggers = {name: std_logging.getLogger(name) for name in levels}
  before = {name: logger.level for name, logger in loggers.items()}
  for name, logger in loggers.items():
    logger.setLevel(levels[name])
  try:
    yield
  finally:
    for name, logger in loggers.items():
      logger.setLevel(before[name])


def _run_watched(pipeline, local: bool) -> None:
  """Runs the pipeline in a thread, and stops waiting for it when a local worker dies.

  The local runner reports a dead worker process (kill -9, the OOM killer) in
  an exception of the thread that started it; it may wait for that worker's
  bundle for ever (it does when the worker dies starting), so this process
  stops waiting and leaves it; the other workers die with this process.
  """
  outcome, started, worker_died, beam_thread_errors = queue.Queue(), [], [], []
  def run_pipeline():
    try:
      started.append(pipeline.run())
      outcome.put(started[-1].wait_until_finish())
    except BaseException as e:  # pylint: disable=broad-except  # Handed to the caller.
      outcome.put(e)
  print_thread_error = threading.excepthook
  def thread_died(error):
    if _WORKER_DIED in str(error.exc_value):
      worker_died.append(error.exc_value)
      outcome.put(_WorkerDied())
    elif _in_beam(error.exc_traceback):  # Printed at the end, unless a dead worker caused it.
      beam_thread_errors.append(error)
    else:
      print_thread_error(error)
  if local:
    threading.excepthook = thread_died
  try:
    threading.Thread(target=run_pipeline, daemon=True, name="beam-pipeline").start()
    ending = outcome.get()
    if (local and isinstance(ending, Exception) and not _USER_ERROR.search(str(ending))
        and not isinstance(ending, (UserError, _WorkerDied))):
      # A dead worker can fail the pipeline before its thread has said it died.
      ending = _worker_death_within(outcome, seconds=2) or ending
    if not worker_died:
      for error in beam_thread_errors:
        print_thread_error(error)
    if isinstance(ending, BaseException):
      raise ending
    if ending != "DONE":  # A local run that was cancelled, say; Dataflow's raise.
      raise UserError(f"the Beam job ended {ending}; run the same command again to finish it")
  finally:
    # After a dead worker, Beam's threads die on as the process ends, each saying again
    # what the one line says: the hook stays for them.
    if not worker_died:
      threading.excepthook = print_thread_error
    if started:
      _cancel_unless_ended(started[-1])


def _in_beam(traceback) -> bool:
  """Whether a thread's exception was raised in Beam's or gRPC's code."""
  while traceback is not None:
    if re.search(r"[/\\](apache_beam|grpc)[/\\]", traceback.tb_frame.f_code.co_filename):
      return True
    traceback = traceback.tb_next
  return False


def _worker_death_within(outcome: queue.Queue, seconds: float):
  deadline = time.monotonic() + seconds
  while (left := deadline - time.monotonic()) > 0:
    try:
      if isinstance(reported := outcome.get(timeout=left), _WorkerDied):
        return reported
    except queue.Empty:
      break
  return None


def _cancel_unless_ended(result) -> None:
  """Interrupted while waiting: a Dataflow job would otherwise run on without us."""
  from apache_beam.runners.runner import PipelineState  # pylint: disable=g-import-not-at-top
  try:
    if not PipelineState.is_terminal(result.state):  # On Dataflow, an API call.
      result.cancel()
  except Exception as e:  # pylint: disable=broad-except  # Best effort, on the way out.
    logging.warning("Could not cancel the Beam job (%s); cancel it with your runner's tools", e)
