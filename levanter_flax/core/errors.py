"""User errors: the exception, its one-line command-line ending, and checks that raise it."""
import os
import sys
import traceback


class UserError(Exception):
  """Bad input from the user: a config key, a file, a path, a shape.

  each command prints it as a single line and exits non-zero, so the message must
  name the culprit on its own.
  """


# Set (to anything but "" or "0") to see the whole traceback behind a one-line error.
DEBUG_VARIABLE = "LEVANTER_FLAX_DEBUG"


def exit_with_error(message: str) -> None:
  """The command-line ending for bad input: one line on stderr, exit status 1.

  With $LEVANTER_FLAX_DEBUG set, the exception being handled comes first,
  with every cause, also those a one-line error hides (`raise ... from None`).
  """
  if os.environ.get(DEBUG_VARIABLE, "") not in ("", "0") and sys.exc_info()[1] is not None:
    _print_whole_chain(sys.exc_info()[1])
  print(f"levanter_flax: error: {message}", file=sys.stderr)
  sys.exit(1)


def _print_whole_chain(error: BaseException) -> None:
  cause = error
  while cause is not None:
    cause.__suppress_context__ = False
    cause = cause.__cause__ or cause.__context__
  traceback.print_exception(error, file=sys.stderr)
