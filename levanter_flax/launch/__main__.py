r"""python -m levanter_flax.launch EXPERIMENT_FILE [--executor=local|xm] [--max_parallel=N]

EXPERIMENT_FILE defines get_experiment() -> levanter_flax.launch.Experiment.
Every work unit's overrides are checked against the config before anything
starts. Exit status 0 when every unit is finished (now or earlier), else 1:
a unit failed, was interrupted, or was refused because its workdir holds a
run of another config.
"""
import pathlib

from absl import app, flags

from levanter_flax.core import cli, paths
from levanter_flax.core.errors import UserError, exit_with_error
from levanter_flax.launch import local, xm
from levanter_flax.launch.experiment import load_experiment, work_units

_EXECUTOR = flags.DEFINE_enum("executor", "local", ["local", "xm"],
                              "local: subprocesses on this machine; xm: the XManager API.")
_MAX_PARALLEL = flags.DEFINE_integer("max_parallel", 1, "Local executor: units running at once.",
                                     lower_bound=1)
_ROOT = flags.DEFINE_string("root", "runs/experiments", "Local executor: <root>/<experiment>/<unit>.")
_XM_TARGET = flags.DEFINE_enum("xm_target", "local", xm.TARGETS, "xm executor: where units run.")
_XM_WORKDIR_ROOT = flags.DEFINE_string("xm_workdir_root", "/workdir",
                                       "xm executor: workdir root inside each container.")


def main(argv: list[str]) -> None:
  if len(argv) != 2:
    exit_with_error("usage: python -m levanter_flax.launch EXPERIMENT_FILE [--executor=local|xm]")
  try:
    experiment = load_experiment(pathlib.Path(argv[1]))
    units = work_units(experiment)
    if _EXECUTOR.value == "xm":
      xm.run(experiment, units, _XM_TARGET.value, _XM_WORKDIR_ROOT.value)
      return
    outcomes = local.run(experiment, units, paths.resolve(_ROOT.value, "--root"),
                         _MAX_PARALLEL.value)
  except UserError as e:
    exit_with_error(str(e))
  print(local.status_table(outcomes))
  unfinished = [f"{o.unit.name} ({o.state})" for o in outcomes
                if o.state not in ("finished", "skipped")]
  if unfinished:
    exit_with_error(f"{len(unfinished)} of {len(outcomes)} work units did not finish: "
                    f"{', '.join(unfinished)}")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
