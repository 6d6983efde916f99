"""The commands users run: one module each, its flags and `main` (the library it calls lives in
the package of its concern), and the Python API (api.py). Commands import everything else;
nothing imports them but the package's own lazy `lf.train`.

This file is the `levanter-flax` console script: `levanter-flax SUBCOMMAND [flags]` runs a
command's module as `python -m levanter_flax.commands.MODULE [flags]` would, e.g.

    levanter-flax train --config=gpt2_nano --config.trainer.num_train_steps=100

Each command keeps its own flags and --help; this adds nothing but the table below.
"""
import runpy
import sys

from levanter_flax.core.errors import exit_with_error

# Subcommand -> the module `python -m` runs for it.
SUBCOMMANDS = {
    "train": "levanter_flax.commands.train",
    "prepare": "levanter_flax.commands.prepare",
    "evaluate": "levanter_flax.commands.evaluate",
    "sample": "levanter_flax.commands.sample",
    "serve": "levanter_flax.commands.serve",
    "export-hf": "levanter_flax.commands.export_hf",
    "report": "levanter_flax.commands.report",
    "launch": "levanter_flax.launch",
    "aot": "levanter_flax.commands.aot",
}



def main(argv: list[str] | None = None) -> None:
  argv = sys.argv if argv is None else argv
  choices = "|".join(SUBCOMMANDS)
  if len(argv) > 1 and argv[1] in ("-h", "--help", "help"):
    print(f"usage: levanter-flax {{{choices}}} [flags]; `levanter-flax SUBCOMMAND --help` lists "
          f"a subcommand's flags")
    return
  if len(argv) < 2:
    exit_with_error(f"no subcommand: levanter-flax {{{choices}}} [flags]")
  if argv[1] not in SUBCOMMANDS:
    exit_with_error(f"unknown subcommand {argv[1]!r}; choose one of {', '.join(SUBCOMMANDS)}")
  # As `python -m`: the module runs as __main__ (its flags and app.run are under that guard)
  # and sees only its own flags.
  sys.argv = [argv[0], *argv[2:]]
  runpy.run_module(SUBCOMMANDS[argv[1]], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
  main()
