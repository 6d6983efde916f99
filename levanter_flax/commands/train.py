"""Training: levanter-flax train --config=configs/gpt2_nano.py [--workdir=DIR], or
--config=gpt2_nano, a shipped config's name; `python -m levanter_flax.main ...` is the same.

Every config field can be overridden, e.g. --config.trainer.batch_size=64.
Bad input ends in one line on stderr naming the culprit, and exit status 1.
"""
from absl import app, flags, logging
from ml_collections import config_flags

from levanter_flax.parallel import backend
from levanter_flax.core import cli, paths
from levanter_flax.config import (define_config_flag, describe_config, parse_flags, run_name,
                                  run_config_of_flags)
from levanter_flax.core.errors import UserError, exit_with_error

define_config_flag("A config file's path, or a shipped config's name (gpt2_nano, "
                             "gpt2:nano), with an optional :VARIANT.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints and metrics; default runs/<config name> "
                               "(runs/gpt2_nano for configs/gpt2.py:nano).")
_PRINT_CONFIG = flags.DEFINE_bool(
    "print_config", False, "Print every config key with its value, its default where the two "
    "differ, and its description; then exit without touching the workdir.")
flags.mark_flag_as_required("config")


def main(argv: list[str]) -> None:
  cli.quiet_orbax()
  if len(argv) > 1:
    exit_with_error(f"unexpected arguments: {' '.join(argv[1:])}")
  config_file = config_flags.get_config_filename(flags.FLAGS["config"])
  try:
    run = run_config_of_flags()
    if _PRINT_CONFIG.value:
      print(describe_config(run))
      return
    workdir = paths.resolve(_WORKDIR.value or f"runs/{run_name(config_file)}",
                            "--workdir")
    backend.start(run.trainer)
    # Heavy (jax, tf); by its module's path: the package's `train` is the Python API's.
    from levanter_flax.training.loop import train_and_evaluate  # pylint: disable=g-import-not-at-top
    final = train_and_evaluate(run, workdir)
  except UserError as e:
    exit_with_error(str(e))
  logging.info("Finished in %s: %s", workdir, final)


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
