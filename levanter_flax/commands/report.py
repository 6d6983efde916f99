r"""Plots and a summary table from the metrics of one or more runs.

  levanter-flax report runs/before runs/after --output_dir=report

Several runs share each plot's axes, so "before and after tuning" is one picture.
"""
from absl import app, flags

from levanter_flax.core import cli, paths
from levanter_flax.core.errors import UserError, exit_with_error
from levanter_flax.monitoring.report import report


def main(argv: list[str]) -> None:
  if len(argv) < 2:
    exit_with_error("usage: levanter-flax report WORKDIR [WORKDIR ...] "
                    "[--output_dir=DIR]")
  try:
    workdirs = [paths.resolve(a, "workdir") for a in argv[1:]]
    print(report(workdirs, paths.resolve(flags.FLAGS.output_dir, "--output_dir")))
  except UserError as e:
    exit_with_error(str(e))


if __name__ == "__main__":
  flags.DEFINE_string("output_dir", "report", "Where the PNG plots go.")
  app.run(main, flags_parser=cli.parse_flags)
