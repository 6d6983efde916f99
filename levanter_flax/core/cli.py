"""What every command line shares: flag errors as one line, and orbax's echoes quieted."""
import logging as std_logging
import os
import sys
import traceback
import warnings

from absl import flags, logging

from levanter_flax.core.errors import UserError, exit_with_error


def parse_flags(argv: list[str]) -> list[str]:
  """For app.run(main, flags_parser=parse_flags): a bad flag is one line, not absl's two.

  A UserError comes from a flag's own parser (a config file, config.define_config_flag).
  """
  try:
    return flags.FLAGS(argv)
  except (flags.Error, UserError) as e:
    exit_with_error(str(e))


def quiet_orbax() -> None:
  """Drops orbax's per-save INFO chatter and the tracebacks of its errors.

  Orbax's warnings and errors still show as one line each; a checkpoint that
  fails to save or restore is also reported by the Checkpointer, once.
  """
  def keep(record: std_logging.LogRecord) -> bool:
    # asyncio's "exception was never retrieved", one per array of a failed save or restore,
    # repeats what the Checkpointer reports once. (Only orbax runs asyncio here; such a record's
    # traceback may start in tensorstore, so it is not always recognisably orbax's.)
    if record.name == "asyncio" and "exception was never retrieved" in record.getMessage():
      return False
    if not _from_orbax(record):
      return True
    record.exc_info, record.exc_text = None, None
    return record.levelno >= std_logging.WARNING

  logging.get_absl_handler().addFilter(keep)
  sys.unraisablehook = _drop_orbax_echoes
  # A failed save can leave one of its array writes never started; Python names it at exit,
  # after the one-line error. (Only orbax runs coroutines here.)
  warnings.filterwarnings("ignore", message=r"coroutine .* was never awaited",
                          category=RuntimeWarning)


_ORBAX = os.sep + "orbax" + os.sep


def _through_orbax(failure) -> bool:
  return failure is not None and any(_ORBAX in f.filename for f in traceback.extract_tb(failure))


def _from_orbax(record: std_logging.LogRecord) -> bool:
  return _ORBAX in record.pathname or _through_orbax(record.exc_info[2] if record.exc_info else None)


def _drop_orbax_echoes(unraisable) -> None:
  """Drops the leftovers of a failed orbax read or write, each already reported once.

  After a failed checkpoint write, tensorstore's pending callbacks reach
  orbax's closed loop ("Event loop is closed"); after a failed restore, the
  reads of the other arrays are abandoned, and Python reports each as
  'Exception ignored' with a traceback.
  """
  closed_loop = (unraisable.exc_type is RuntimeError
                 and "Event loop is closed" in str(unraisable.exc_value))
  if not (closed_loop or _through_orbax(unraisable.exc_traceback)):
    sys.__unraisablehook__(unraisable)


def run_moved(subcommand: str) -> None:
  """Runs `levanter-flax SUBCOMMAND` for its module's path before the commands moved into
  commands/ (`python -m levanter_flax.prepare`, which users' scripts call), after saying once,
  on stderr, what replaces that path."""
  import runpy  # pylint: disable=g-import-not-at-top
  module = subcommand.replace("-", "_")
  print(f"levanter_flax: `python -m levanter_flax.{module}` is now `levanter-flax {subcommand}` "
        f"(python -m levanter_flax.commands.{module})", file=sys.stderr)
  runpy.run_module(f"levanter_flax.commands.{module}", run_name="__main__", alter_sys=True)
