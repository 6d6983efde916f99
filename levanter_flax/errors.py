"""The one exception type that reaches the user as a one-line message."""
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
