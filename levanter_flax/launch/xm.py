"""Runs an experiment through the XManager API: one xm work unit per sweep point.

Needs the optional `xmanager` package (pip install -e ".[xm]") and, for its
container-based executors, Docker. Targets: xm_local's Local, Vertex AI and
Kubernetes executors.
"""
import pathlib

from levanter_flax.core.errors import UserError
from levanter_flax.launch.experiment import Experiment, WorkUnit

TARGETS = ("local", "vertex", "kubernetes")
_REPO = pathlib.Path(__file__).resolve().parents[2]


def run(experiment: Experiment, units: list[WorkUnit], target: str, workdir_root: str) -> None:
  try:
    from xmanager import xm, xm_local  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise UserError("--executor=xm needs the xmanager package: pip install -e \".[xm]\" "
                    "(or pip install xmanager); its Local, Vertex and Kubernetes executors "
                    "also need Docker") from None
  executor = {"local": xm_local.Local, "vertex": xm_local.Vertex,
              "kubernetes": xm_local.Kubernetes}[target]
  extra = "" if target == "local" else "[gpu]"
  with xm_local.create_experiment(experiment_title=experiment.name) as xp:
    [executable] = xp.package([xm.python_container(
        executor_spec=executor.Spec(), path=str(_REPO),
        entrypoint=xm.ModuleName("levanter_flax.main"),
        # xmanager's default image wants a requirements.txt; this project installs from setup.py.
        docker_instructions=["ENV LANG=C.UTF-8", f"COPY {_REPO.name}/ /levanter_flax",
                             "WORKDIR /levanter_flax", f"RUN python -m pip install -e '.{extra}'"])])
    for unit in units:
      args = {"workdir": f"{workdir_root}/{experiment.name}/{unit.name}", "config": experiment.config,
              **{f"config.{k}": v for k, v in unit.overrides.items()}}
      xp.add(xm.Job(executable=executable, executor=executor(), args=args))
