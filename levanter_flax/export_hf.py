"""`python -m levanter_flax.export_hf`: the path of `levanter-flax export-hf` before the
commands moved into commands/, kept for the scripts that call it."""
from levanter_flax.core import cli

if __name__ == "__main__":
  cli.run_moved("export-hf")
