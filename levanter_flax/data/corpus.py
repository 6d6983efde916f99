"""The built-in corpus: the Python standard library's own source files.

It is real text that exists on every machine that runs this trainer, so the
default configs train offline with nothing to download.
"""
import pathlib
import sys
import sysconfig
from typing import Iterator


def stdlib_root() -> pathlib.Path:
  return pathlib.Path(sysconfig.get_paths()["stdlib"])


def stdlib_name() -> str:
  return f"stdlib-py{sys.version_info.major}.{sys.version_info.minor}"


def stdlib_documents() -> Iterator[tuple[str, str]]:
  """Yields (relative path, text) for every stdlib .py file, in a fixed order.

  Installed packages are excluded so the corpus does not depend on what pip
  put into the interpreter. A few stdlib test files are deliberately not
  UTF-8; their bad bytes are replaced rather than the files dropped.
  """
  root = stdlib_root()
  paths = sorted(p for p in root.rglob("*.py")
                 if "site-packages" not in p.parts and "dist-packages" not in p.parts)
  for path in paths:
    yield str(path.relative_to(root)), path.read_bytes().decode("utf-8", errors="replace")
