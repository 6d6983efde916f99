"""`python -m levanter_flax.report`: the path of `levanter-flax report` before the commands moved
into commands/, kept for the scripts that call it."""
from levanter_flax.core import cli

if __name__ == "__main__":
  cli.run_moved("report")
