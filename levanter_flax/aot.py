"""`python -m levanter_flax.aot`: the path of `levanter-flax aot` before the commands moved
into commands/, kept for the scripts that call it."""
from levanter_flax.core import cli

if __name__ == "__main__":
  cli.run_moved("aot")
