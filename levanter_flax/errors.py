"""The one exception type that reaches the user as a one-line message."""


class UserError(Exception):
  """Bad input from the user: a config key, a file, a path, a shape.

  main.py prints it as a single line and exits non-zero, so the message must
  name the culprit on its own.
  """
