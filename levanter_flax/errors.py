"""User errors: the exception, its one-line command-line ending, and checks that raise it."""
import os
import pathlib
import sys


class UserError(Exception):
  """Bad input from the user: a config key, a file, a path, a shape.

  main.py prints it as a single line and exits non-zero, so the message must
  name the culprit on its own.
  """


def exit_with_error(message: str) -> None:
  """The command-line ending for bad input: one line on stderr, exit status 1."""
  print(f"levanter_flax: error: {message}", file=sys.stderr)
  sys.exit(1)


def ensure_writable_dir(directory: pathlib.Path, what: str) -> pathlib.Path:
  """Creates `directory` if needed, or raises a UserError calling it `what`."""
  try:
    directory.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise UserError(f"cannot create {what} {directory}: {e.strerror or e}") from e
  if not os.access(directory, os.W_OK):
    raise UserError(f"{what} {directory} is not writable")
  return directory
