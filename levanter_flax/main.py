"""`python -m levanter_flax.main [flags]` is `levanter-flax train [flags]` (commands/train.py),
by the name the first runs' scripts and the docs' examples use."""
import runpy

if __name__ == "__main__":
  runpy.run_module("levanter_flax.commands.train", run_name="__main__", alter_sys=True)
