"""Command line: python -m levanter_flax.main --config=configs/gpt2_nano.py [--workdir=DIR].

Every config field can be overridden, e.g. --config.trainer.batch_size=64.
Bad input ends in one line on stderr naming the culprit, and exit status 1.
"""
import logging as std_logging
import os
import pathlib
import re
import sys
import traceback

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from levanter_flax import distributed
from levanter_flax.config import to_run_config
from levanter_flax.errors import UserError, exit_with_error

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file in configs/.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints and metrics; default runs/<config name>.")
flags.mark_flag_as_required("config")


def _config_path(argv: list[str]) -> str:
  for i, arg in enumerate(argv):
    if arg.startswith("--config="):
      return arg.split("=", 1)[1]
    if arg == "--config" and i + 1 < len(argv):
      return argv[i + 1]
  return "?"


def _describe_flag_error(error: Exception, argv: list[str]) -> str:
  """One line for whatever config_flags raised while loading the file or an override."""
  while error.args and isinstance(error.args[0], Exception):  # config_dict nests KeyErrors.
    error = error.args[0]
  text = str(error.args[0] if error.args else error)
  if isinstance(error, (AttributeError, KeyError)):
    unknown = re.search(r"'(\w+)'", text)
    overrides = [a for a in argv if unknown and a.startswith("--config.") and unknown.group(1) in a]
    hint = re.search(r"Did you mean \"(\w+)\"", text)
    culprit = overrides[0].split("=", 1)[0] if overrides else (unknown.group(1) if unknown else text)
    return f"unknown config key {culprit}" + (f" (did you mean {hint.group(1)!r}?)" if hint else "")
  if isinstance(error, OSError) and "config file" in text:
    reason = text.strip().splitlines()[-1].strip()
    return f"cannot load config file {_config_path(argv)}: {reason}"
  if isinstance(error, SyntaxError):
    return f"config file {error.filename}, line {error.lineno}: {error.msg}"
  first_line = text.strip().splitlines()[0] if text.strip() else type(error).__name__
  return f"config {_config_path(argv)}: {first_line}"


def _parse_flags(argv: list[str]) -> list[str]:
  try:
    rest = flags.FLAGS(argv)
    _CONFIG.value.keys()  # Surfaces an error config_flags deferred while loading the file.
  except flags.Error as e:
    exit_with_error(str(e))
  except Exception as e:  # pylint: disable=broad-except
    exit_with_error(_describe_flag_error(e, argv))
  return rest


def _quiet_library_logs() -> None:
  """Drops orbax's per-save INFO chatter and the tracebacks of its errors.

  Orbax's warnings and errors still show as one line each; a save that fails
  also ends the run with our own one-line error naming the checkpoint.
  """
  def keep(record: std_logging.LogRecord) -> bool:
    if not _from_orbax(record):
      return True
    record.exc_info, record.exc_text = None, None
    # asyncio's "exception was never retrieved", one per array, repeats what orbax reported.
    return record.levelno >= std_logging.WARNING and record.name != "asyncio"

  logging.get_absl_handler().addFilter(keep)
  sys.unraisablehook = _drop_closed_loop_errors


def _from_orbax(record: std_logging.LogRecord) -> bool:
  orbax = os.sep + "orbax" + os.sep
  failure = record.exc_info[2] if record.exc_info else None
  return orbax in record.pathname or (
      failure is not None and any(orbax in frame.filename for frame in traceback.extract_tb(failure)))


def _drop_closed_loop_errors(unraisable) -> None:
  """After a failed checkpoint write, tensorstore's pending callbacks reach orbax's closed loop.

  Each would print a traceback; the failed save itself is reported once, by the Checkpointer.
  """
  if not (unraisable.exc_type is RuntimeError and "Event loop is closed" in str(unraisable.exc_value)):
    sys.__unraisablehook__(unraisable)


def _join_other_processes(cfg: distributed.DistributedConfig) -> None:
  """jax.distributed first, before any backend exists; then only process 0 logs progress."""
  distributed.initialize(cfg)
  if jax.process_index() > 0:
    logging.set_verbosity(logging.WARNING)


def main(argv: list[str]) -> None:
  _quiet_library_logs()
  if len(argv) > 1:
    exit_with_error(f"unexpected arguments: {' '.join(argv[1:])}")
  config_file = config_flags.get_config_filename(flags.FLAGS["config"])
  workdir = pathlib.Path(_WORKDIR.value or pathlib.Path("runs") / pathlib.Path(config_file).stem)
  try:
    run = to_run_config(_CONFIG.value)
    _join_other_processes(run.trainer.distributed)
    from levanter_flax import train  # pylint: disable=g-import-not-at-top  # Heavy: jax, tf.
    final = train.train_and_evaluate(run, workdir)
  except UserError as e:
    exit_with_error(str(e))
  logging.info("Finished in %s: %s", workdir, final)


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
