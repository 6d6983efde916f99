"""The run's train step compiled for a topology: memory per chip, whether it fits, FLOPs and
collectives; and what to try when it does not fit.

The step is the trainer's own (step.build), with the run's mesh, shardings, global batch and
gradient accumulation, so what the compiler reports is what the pod would run:
- memory per chip (memory_analysis) is the hardware's verdict: a step that does not fit here
  does not fit there;
- FLOPs and collective bytes are counts of the compiled program;
- `optimal_seconds` is the compiler's idealized cost model, not a step time: a relative signal
  between two compiles on the same libtpu only.

A scanned layer stack is one while loop whose body the compiler's cost model counts once: its
FLOPs and bound come from unrolled compiles of 2 and 4 layers, extrapolated to the model's depth
(each layer costs the same), and its collectives from the real program's HLO, the loop's body
counted as often as it runs. A pipelined step's FLOPs and bound come from compiles of one and two
layers a stage with the pipeline's loops (its iterations, each stage's layers) unrolled.
"""
import dataclasses
import math
import re
from typing import Any

import jax
from absl import logging

from levanter_flax import objectives
from levanter_flax.config import settings
from levanter_flax.core import progress
from levanter_flax.core.errors import UserError
from levanter_flax.models import common, pipeline
from levanter_flax.objectives.base import Objective
from levanter_flax.parallel import partitioning
from levanter_flax.plan.hlo import collective_bytes
from levanter_flax.plan.slices import GIB, HBM_BYTES, devices
from levanter_flax.training import batch_search, choices, step


@dataclasses.dataclass(frozen=True)
class Costs:
  """What the compiler's cost model says of one step, for the whole topology."""
  flops: float
  optimal_seconds: float

  def scaled(self, other: "Costs", factor: float) -> "Costs":
    """self + factor * (other - self), each figure."""
    line = lambda a, b: a + factor * (b - a)
    return Costs(line(self.flops, other.flops), line(self.optimal_seconds, other.optimal_seconds))

  def times(self, factor: float) -> "Costs":
    return Costs(factor * self.flops, factor * self.optimal_seconds)


def _costs(compiled, chip_count: int) -> Costs:
  analysis = compiled.cost_analysis()
  analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
  return Costs(flops=float(analysis.get("flops", 0.0)) * chip_count,
               optimal_seconds=float(analysis.get("optimal_seconds", 0.0)))


def _steps(run: settings.RunConfig, partitioner: partitioning.Partitioner,
           objective: Objective) -> step.ShardedSteps:
  """The step as the run trains it by `objective`."""
  return step.build(run, partitioner, eos_id=0 if run.data.document_masking else None,
                    objective=objective)


def _compile(run: settings.RunConfig, partitioner: partitioning.Partitioner,
             steps: step.ShardedSteps):
  what = (f"compile the step ({run.model.num_layers} layers, batch {run.trainer.batch_size}) for "
          f"{partitioner.mesh.devices.flat[0].device_kind} x {partitioner.mesh.size}")
  with partitioner.activation_context(), progress.waiting(what):
    return steps.train_step.lower(*steps.abstract_inputs(run.trainer.batch_size)).compile()


def _compiler_error(error: Exception) -> str:
  """The line of a compile error that names the cause: MLIR's error with its source line."""
  text = str(error)
  detail = re.search(r"(\S+\.py:\d+:\d+: error: [^\n]*)", text)
  return detail.group(1) if detail else text.strip().splitlines()[0]


def step_costs(run: settings.RunConfig, partitioner: partitioning.Partitioner,
               compiled=None, objective: Objective = step.NEXT_TOKEN,
               schedule: pipeline.Schedule | None = None) -> Costs:
  """The compiler's costs of the step (`compiled`, or compiled here), whose cost model counts a
  loop's body once. Accumulated microbatches: one microbatch's step times their count (its
  optimizer update too: a rounding). Scanned layers: extrapolated from unrolled compiles of 2
  and 4 layers. Pipelined (`schedule`): from compiles of one and two layers a stage's chunk,
  the pipeline's loops unrolled."""
  chip_count = partitioner.mesh.size
  trainer = run.trainer
  if trainer.gradient_accumulation_steps > 1:
    one = dataclasses.replace(trainer, gradient_accumulation_steps=1,
                              batch_size=trainer.batch_size // trainer.gradient_accumulation_steps)
    return step_costs(dataclasses.replace(run, trainer=one), partitioner, None, objective,
                      schedule).times(trainer.gradient_accumulation_steps)
  if schedule is not None:
    per_chunk = schedule.stages * schedule.repeats
    depths, scan = (per_chunk, 2 * per_chunk), True
  elif run.model.compute.scan_layers:
    depths, scan = (2, 4), False
  else:
    return _costs(compiled or _compile(run, partitioner, _steps(run, partitioner, objective)),
                  chip_count)
  shallow_costs = []
  for depth in depths:
    model = dataclasses.replace(common.with_compute(run.model, scan_layers=scan),
                                num_layers=depth)
    logging.info("Compiling %d layers, loops unrolled, to count the step's costs", depth)
    shallow_run = dataclasses.replace(run, model=model)
    # jit's trace cache keys a step on its function and arguments, not on unrolled_loops: a
    # step traced before (the run's own, where it is this deep) must not be reused, nor these
    # traces after.
    jax.clear_caches()
    try:
      with pipeline.unrolled_loops():
        shallow = _compile(shallow_run, partitioner, _steps(shallow_run, partitioner, objective))
    finally:
      jax.clear_caches()
    shallow_costs.append(_costs(shallow, chip_count))
  return shallow_costs[0].scaled(shallow_costs[1],
                                 (run.model.num_layers - depths[0]) / (depths[1] - depths[0]))


def plan(run: settings.RunConfig, topology_name: str, num_slices: int = 1,
         compiler_costs: bool = True, objective_name: str = "next_token") -> dict[str, Any]:
  """Compiles the run's train step for the topology; the plan's figures, JSON-ready.

  compiler_costs: also the compiler's FLOPs and bound (two more compiles for scanned layers or a
  pipeline); else those are None for scanned layers. objective_name: the step as that objective
  (objectives.OBJECTIVES) trains it, its batch entries and any reference model (in training,
  the data decides).
  """
  objective = objectives.of_run(objective_name, run)
  target = devices(topology_name, num_slices)
  # A compile-only executable cannot be read back from the persistent cache: do not write it.
  jax.config.update("jax_enable_compilation_cache", False)
  capacity = HBM_BYTES.get(target[0].device_kind)
  if capacity is None:
    raise UserError(f"--topology={topology_name}: no HBM size known for {target[0].device_kind}")
  try:
    mesh = partitioning.make_mesh(run.trainer.device_mesh, target, run.trainer.dcn_mesh)
  except UserError as e:
    raise UserError(f"{e}: {topology_name} x {num_slices} slice(s) has {len(target)} chips") \
        from None
  partitioner = partitioning.Partitioner(mesh, run.sharding)
  searched = {}  # The search's compiled steps: the chosen one is not compiled again.
  if run.trainer.batch_size == "auto":
    run = dataclasses.replace(run, trainer=batch_search.resolve(run, partitioner, capacity,
                                                                searched, objective=objective))
  trainer = run.trainer
  choices.check_batch_size(trainer, partitioner, processes=1)
  logging.info("Compiling the train step for %s x %d (%d chips), batch %d", topology_name,
               num_slices, len(target), trainer.batch_size)
  steps = _steps(run, partitioner, objective)
  tokens = trainer.batch_size * run.model.seq_len
  result = {
      "topology": topology_name,
      "num_slices": num_slices,
      "chips": len(target),
      "device_kind": target[0].device_kind,
      "mesh": dict(mesh.shape),
      "batch_size": trainer.batch_size,
      "gradient_accumulation_steps": trainer.gradient_accumulation_steps,
      "objective": objective.name,
      "hbm_per_chip_bytes": capacity,
      "tokens_per_step": tokens,
      "model_flops_per_step": tokens * steps.flops_per_token(run.model),
      "int8_model_flops_per_step": tokens * steps.int8_flops_per_token(run.model),
      "pipeline": steps.pipeline_schedule and steps.pipeline_schedule._asdict(),
  }
  accumulation = trainer.gradient_accumulation_steps
  chosen = searched.get((trainer.batch_size // (partitioner.data_parallel_size * accumulation),
                         accumulation))
  planned = {**result, **_memory_and_costs(run, partitioner, steps, capacity, compiler_costs,
                                           chosen)}
  if objective.reads == "rollouts":  # Its generations hold the state and the engine's cache.
    planned["generation_bytes_per_chip"] = batch_search.generation_bytes(
        run, partitioner, steps, trainer.batch_size)
    planned["fits"] = planned["fits"] and planned["generation_bytes_per_chip"] <= capacity
  if not planned["fits"]:
    # Whether any batch fits: the step of one sequence per data-parallel device, no accumulation.
    planned["smallest_step_bytes_per_chip"] = batch_search.step_bytes(run, partitioner, 1,
                                                                      objective=objective)
  opposite = stages_inside_slices(trainer, num_slices)
  if num_slices > 1 and opposite is not None and planned["collective_bytes_per_step"]:
    planned["stages_inside_slices"] = _opposite_plan(run, opposite, topology_name, num_slices,
                                                     objective_name)
  return planned


def stages_inside_slices(trainer: settings.TrainerConfig, num_slices: int):
  """For a layout with a pipeline's stages across slices and data inside them, the opposite
  (device_mesh, dcn_mesh): the stages inside each slice and data across them, the other sizes
  kept; None for any other layout."""
  stage = partitioning.STAGE_AXIS
  ici, dcn = dict(trainer.device_mesh), dict(trainer.dcn_mesh)
  if -1 in dcn.values():  # The one axis of the slices left: num_slices over the others.
    rest = math.prod(size for size in dcn.values() if size != -1)
    dcn = {axis: num_slices // rest if size == -1 else size for axis, size in dcn.items()}
  stages, data = dcn.get(stage, 1), ici.get("data", 1)
  if stages < 2 or data == 1 or (data > 0 and data % stages):
    return None
  ici = dict(ici) if stage in ici else {stage: 1, **ici}
  ici[stage] *= stages
  ici["data"] = -1 if data == -1 else data // stages
  dcn = {**dcn, stage: 1, "data": dcn.get("data", 1) * stages}
  return tuple(ici.items()), tuple(dcn.items())


def _opposite_plan(run: settings.RunConfig, layout, topology_name: str, num_slices: int,
                   objective_name: str) -> dict[str, Any]:
  """stages_inside_slices' layout planned (no compiler costs): its memory and what it sends
  across slices, or why it cannot run."""
  device_mesh, dcn_mesh = layout
  other = dataclasses.replace(run, trainer=dataclasses.replace(
      run.trainer, device_mesh=device_mesh, dcn_mesh=dcn_mesh))
  described = {"device_mesh": dict(device_mesh), "dcn_mesh": dict(dcn_mesh)}
  logging.info("Planning the stages inside each slice, data across them, to compare")
  try:
    planned = plan(other, topology_name, num_slices, False, objective_name)
  except UserError as e:
    return {**described, "error": str(e)}
  return {**described, "fits": planned["fits"], "bytes_per_chip": planned["bytes_per_chip"],
          "across_slices_bytes": across_slices(planned)}


def across_slices(result: dict[str, Any]) -> int:
  """A plan's bytes per chip per step sent across slices, every kind."""
  return sum(v for k, v in result["collective_bytes_per_step"].items() if "across slices" in k)


def _memory_and_costs(run: settings.RunConfig, partitioner: partitioning.Partitioner,
                      steps: step.ShardedSteps, capacity: int, compiler_costs: bool,
                      compiled=None) -> dict[str, Any]:
  """The compiled step's memory per chip, whether it fits a chip of `capacity` bytes, and its
  costs; `compiled`: the step, where the batch search has compiled it already."""
  try:
    if compiled is None:
      compiled = _compile(run, partitioner, steps)
  except jax.errors.JaxRuntimeError as e:
    temporaries = batch_search.out_of_memory_bytes(e)
    if temporaries is None:
      raise UserError(f"the TPU compiler rejected the step for {partitioner.mesh.size} "
                      f"{partitioner.mesh.devices.flat[0].device_kind} chips: "
                      f"{_compiler_error(e)}") from None
    # The compiler refuses a step that does not fit: no program, so no counts, and the memory
    # from its message and the state's layout.
    arguments = partitioning.per_device_bytes(steps.abstract_state, steps.state_shardings)
    return {"bytes_per_chip": arguments + temporaries,
            "argument_bytes_per_chip": arguments, "temp_bytes_per_chip": temporaries,
            "fits": False, "compiler_flops_per_step": None, "compiler_bound_seconds": None,
            "collective_bytes_per_step": {}}
  memory = compiled.memory_analysis()
  needed = batch_search.needed_bytes(memory)
  if compiler_costs:
    costs = step_costs(run, partitioner, compiled, steps.objective, steps.pipeline_schedule)
  else:  # No more compiles: the step's own count, where it has no loop the count misses.
    costs = (_costs(compiled, partitioner.mesh.size) if not run.model.compute.scan_layers
             and run.trainer.gradient_accumulation_steps == 1 else None)
  return {
      "bytes_per_chip": needed,
      "argument_bytes_per_chip": memory.argument_size_in_bytes,
      "temp_bytes_per_chip": memory.temp_size_in_bytes,
      "fits": needed <= capacity,
      "compiler_flops_per_step": costs.flops if costs else None,
      "compiler_bound_seconds": costs.optimal_seconds if costs and costs.optimal_seconds > 0
                                else None,
      "collective_bytes_per_step": collective_bytes(compiled.as_text()),
  }


def advice(run: settings.RunConfig, result: dict[str, Any]) -> str:
  """What to try for a step that does not fit: the setting likely to save the most memory per
  chip; where not even the smallest batch fits, every remedy but a smaller batch."""
  temps, arguments = result["temp_bytes_per_chip"], result["argument_bytes_per_chip"]
  data_parallel = dict(result["mesh"]).get("data", 1)
  savings = {"a smaller trainer.batch_size (or more gradient_accumulation_steps)": temps / 2}
  if run.sharding.parameter_axis is None and data_parallel > 1:
    savings["ZeRO-3: sharding.parameter_axis=data"] = arguments * (1 - 1 / data_parallel)
  if run.model.compute.remat == "none":
    savings["model.compute.remat=full"] = temps * 0.7
  smallest = result.get("smallest_step_bytes_per_chip", 0)
  if smallest <= result["hbm_per_chip_bytes"]:
    return "try " + max(savings, key=savings.get)
  del savings["a smaller trainer.batch_size (or more gradient_accumulation_steps)"]
  remedies = [*sorted(savings, key=savings.get, reverse=True),
              "more chips (a larger --topology or --num_slices)"]
  return (f"no batch fits: even the smallest (one sequence per data-parallel device, no "
          f"accumulation) needs {smallest / GIB:.2f} GiB per chip; try " + ", or ".join(remedies))


def needed_per_chip(result: dict[str, Any]) -> int:
  """The most the run holds on a chip: its step's, or a generation's where it samples."""
  return max(result["bytes_per_chip"], result.get("generation_bytes_per_chip", 0))


def describe(result: dict[str, Any]) -> str:
  """The plan as lines for a terminal."""
  gib = lambda n: f"{n / GIB:.2f} GiB"
  margin = result["hbm_per_chip_bytes"] - needed_per_chip(result)
  bound = result["compiler_bound_seconds"]
  lines = [
      f"{result['topology']} x {result['num_slices']} slice(s): {result['chips']} chips "
      f"({result['device_kind']}), mesh {result['mesh']}",
      f"batch {result['batch_size']} x {result['gradient_accumulation_steps']} microbatch(es), "
      f"{result['tokens_per_step']:,} tokens per step",
      f"memory per chip: {gib(result['bytes_per_chip'])} of {gib(result['hbm_per_chip_bytes'])} "
      f"(temporaries {gib(result['temp_bytes_per_chip'])}): "
      + (f"fits, {gib(margin)} to spare" if result["fits"] else f"does NOT fit, {gib(-margin)} "
         "short"),
      *([f"pipeline: {pipeline.Schedule(**result['pipeline']).describe()}"]
        if result.get("pipeline") else []),
      f"model FLOPs per step {result['model_flops_per_step']:.4g}" + (
          f", {result['int8_model_flops_per_step']:.4g} of them int8"
          if result.get("int8_model_flops_per_step") else ""),
  ]
  if "generation_bytes_per_chip" in result:
    lines.insert(3, f"memory per chip while generating (the state and the KV cache of "
                    f"{result['batch_size']} completions): "
                    f"{gib(result['generation_bytes_per_chip'])}")
  if not result["fits"] and not result["collective_bytes_per_step"]:
    lines.append("the compiler refused the step for want of memory: no counts")
    return "\n".join(lines)
  flops = result["compiler_flops_per_step"]
  lines += [
      "collective bytes per chip per step: " + (", ".join(
          f"{k} {gib(v)}" for k, v in result["collective_bytes_per_step"].items() if v) or "none"),
      f"the compiler counts {flops:.4g} FLOPs per step" if flops is not None else
      "the compiler's FLOPs and bound: not counted (--nocompiler_costs)",
      "compiler's idealized bound: " + (f"{bound:.4g} s (a relative signal between compiles, "
                                        "not a step time)" if bound else "none given"),
  ]
  if "stages_inside_slices" in result:
    lines.append(_compared_layouts(result))
  return "\n".join(lines)


def _compared_layouts(result: dict[str, Any]) -> str:
  """The stages across slices against inside them (stages_inside_slices): a warning where the
  other layout fits and sends less across slices."""
  other = result["stages_inside_slices"]
  meshes = f"device_mesh {other['device_mesh']}, dcn_mesh {other['dcn_mesh']}"
  if "error" in other:
    return f"the stages inside each slice instead ({meshes}) cannot run: {other['error']}"
  ours, theirs = across_slices(result), other["across_slices_bytes"]
  figures = (f"{theirs / GIB:.3g} GiB a chip per step across slices against these stages' "
             f"{ours / GIB:.3g}; HBM {other['bytes_per_chip'] / GIB:.2f} GiB a chip")
  if other["fits"] and theirs < ours:
    return (f"warning: the stages inside each slice and data across them send less across "
            f"slices ({meshes}): {figures}")
  return f"the stages inside each slice instead ({meshes}): {figures}" + (
      "" if other["fits"] else ", does not fit")
