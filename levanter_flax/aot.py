"""The fit plan before launch: the run's train step compiled for a TPU topology, on any machine.

    python -m levanter_flax.aot --config=configs/llama_7b.py --topology=v5p-64 \\
        [--num_slices=2] [--config.x=y ...] [--output=plan.json]

libtpu (`pip install -e ".[tpu-aot]"`) compiles for TPU chips that are not
there: jax's compile-only devices of the topology. The step is the trainer's
own (step.build), with the run's mesh, shardings, global batch and gradient
accumulation, so what the compiler reports is what the pod would run:

- memory per chip (memory_analysis) is the hardware's verdict: a step that
  does not fit here does not fit there;
- FLOPs and collective bytes are counts of the compiled program;
- `optimal_seconds` is the compiler's idealized cost model, not a step time:
  a relative signal between two compiles on the same libtpu only.

A scanned layer stack is one while loop whose body the compiler's cost model
counts once: its FLOPs and bound come from unrolled compiles of 2 and 4 layers,
extrapolated to the model's depth (each layer costs the same), and its
collectives from the real program's HLO, the loop's body counted as often as it
runs. Nothing here touches a TPU, the network or the workdir; TensorFlow is
never imported.
"""
import dataclasses
import importlib.util
import json
import math
import os
import re
from typing import Any, Optional

import jax
from absl import app, flags, logging

from levanter_flax.training import batch_search, step
from levanter_flax.parallel import partitioning
from levanter_flax.core import progress
from levanter_flax.config import settings
from levanter_flax.config import define_config_flag, parse_flags, run_config_of_flags
from levanter_flax.core.errors import UserError, exit_with_error
from levanter_flax.models import common

GIB = 1 << 30
# HBM per chip by jax's device_kind: compile-only devices report no memory of their own.
HBM_BYTES = {
    "TPU v4": 32 * GIB,
    "TPU v5 lite": 16 * GIB,  # v5e
    "TPU v5": 95 * GIB,  # v5p
    "TPU v5p": 95 * GIB,
    "TPU v6 lite": 32 * GIB,  # v6e (Trillium)
}
# Chips -> physical shape, for the Cloud TPU names: 3D tori (v4, v5p) and 2D ones (v5e, v6e).
_SHAPES_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
              256: "4x8x8", 512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16"}
_SHAPES_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
              256: "16x16"}
# Generation -> (its torus's shapes, TensorCores the Cloud TPU name counts per chip).
_GENERATIONS = {"v4": (_SHAPES_3D, 2), "v5p": (_SHAPES_3D, 2), "v5e": (_SHAPES_2D, 1),
                "v6e": (_SHAPES_2D, 1)}
_EXAMPLES = "v4-32, v5e-256, v5p-128, v6e-64, v5e:16x16 or v5p:4x4x4"
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


def topology(name: str) -> tuple[str, str]:
  """(generation, jax's topology name "v5p:4x4x4") for a Cloud TPU name or jax's own.

  The Cloud TPU suffix counts TensorCores on v4 and v5p (two per chip) and chips on v5e
  and v6e: v4-32 and v5p-32 are 16 chips, v5e-32 is 32.
  """
  cloud = re.fullmatch(r"(v4|v5p|v5e|v5litepod|v6e)-(\d+)", name)
  if cloud:
    generation = "v5e" if cloud.group(1) == "v5litepod" else cloud.group(1)
    shapes, cores_per_chip = _GENERATIONS[generation]
    cores = int(cloud.group(2))
    if cores % cores_per_chip or cores // cores_per_chip not in shapes:
      raise UserError(f"--topology={name}: no {generation} slice of {cores} "
                      f"{'TensorCores' if cores_per_chip > 1 else 'chips'}; sizes are "
                      f"{', '.join(str(c * cores_per_chip) for c in shapes)}")
    return generation, f"{generation}:{shapes[cores // cores_per_chip]}"
  jax_name = re.fullmatch(r"(v4|v5p|v5e|v6e):(\d+x\d+(?:x\d+)?)", name)
  if jax_name and jax_name.group(2).count("x") == (2 if jax_name.group(1) in ("v4", "v5p") else 1):
    return jax_name.group(1), name
  raise UserError(f"--topology={name}: unknown TPU topology; use a Cloud TPU name or jax's, "
                  f"e.g. {_EXAMPLES}")


def chips(name: str) -> int:
  """Chips in one slice of the topology `name`."""
  return _chip_count(topology(name)[1].split(":")[1])


def devices(name: str, num_slices: int = 1) -> list[jax.Device]:
  """The compile-only devices of `num_slices` slices of topology `name`: one per chip."""
  generation, jax_name = topology(name)
  if num_slices < 1:
    raise UserError(f"--num_slices must be at least 1; got {num_slices}")
  if importlib.util.find_spec("libtpu") is None:
    raise UserError("compiling for a TPU needs libtpu: pip install -e \".[tpu-aot]\" (the "
                    "version jax[tpu] pins, see docs/build-notes.md)")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # No metadata server: this is not a TPU VM.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # Its lockfile is for real chips.
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  # v4 runs as megacore, one device per chip, as on a real v4 VM.
  options = {"chip_config_name": "megacore"} if generation == "v4" else {}
  try:
    return list(topologies.get_topology_desc(topology_name=jax_name, platform="tpu",
                                             num_slices=num_slices, **options).devices)
  except jax.errors.JaxRuntimeError as e:
    shapes, _ = _GENERATIONS[generation]
    raise UserError(f"--topology={name}: libtpu has no {generation} topology {jax_name} "
                    f"({str(e).splitlines()[0]}); {generation} comes in "
                    f"{', '.join(sorted(set(shapes.values()), key=_chip_count))}") from e


def _chip_count(shape: str) -> int:
  return math.prod(int(n) for n in shape.split("x"))


@dataclasses.dataclass(frozen=True)
class Costs:
  """What the compiler's cost model says of one step, for the whole topology."""
  flops: float
  optimal_seconds: float

  def scaled(self, other: "Costs", factor: float) -> "Costs":
    """self + factor * (other - self), each figure."""
    line = lambda a, b: a + factor * (b - a)
    return Costs(line(self.flops, other.flops), line(self.optimal_seconds, other.optimal_seconds))


_SHAPE = re.compile(r"\b(pred|s4|s8|s16|s32|s64|u4|u8|u16|u32|u64|f16|bf16|f32|f64|f8e4m3fn|"
                    r"f8e5m2)\[([\d,]*)\]")
_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "f8e4m3fn": 8, "f8e5m2": 8, "s16": 16,
         "u16": 16, "f16": 16, "bf16": 16, "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64,
         "f64": 64}
_OP = re.compile(r"=\s*(.*?)\s(" + "|".join(COLLECTIVES) + r")(-start)?\(")
# What a multi-slice program sends over the data-center network: host transfers that the
# megascale runtime carries, one per collective's share that leaves the slice.
_DCN_SEND = re.compile(r"=\s*\((.*?)\)\s+send\(.*_xla_megascale_transfer_type=\"?([A-Z_]+)")
_DCN_KINDS = {"ALL_GATHER": "all-gather", "REDUCE_SCATTER": "reduce-scatter",
              "ALL_REDUCE": "all-reduce", "ALL_TO_ALL": "all-to-all",
              "ONE_TO_ONE": "collective-permute"}


def _array_bytes(hlo_type: str) -> int:
  """Bytes of the arrays in an HLO type: "bf16[8,128]{1,0}", or every one of a tuple's."""
  return sum(math.prod(int(d) for d in dims.split(",") if d) * _BITS[dtype] // 8
             for dtype, dims in _SHAPE.findall(hlo_type))


def _tuple_elements(hlo_type: str) -> list[str]:
  """A tuple type's top-level elements; [hlo_type] for an array."""
  if not hlo_type.startswith("("):
    return [hlo_type]
  elements, depth, start = [], 0, 1
  for i, char in enumerate(hlo_type):
    depth += char in "([{"
    depth -= char in ")]}"
    if (char == "," and depth == 1) or depth == 0:
      elements.append(hlo_type[start:i])
      start = i + 1
    if depth == 0:
      break
  return elements


def collective_bytes(hlo_text: str) -> dict[str, int]:
  """Bytes of each kind of collective's results on one chip per step, from compiled HLO text;
  of a multi-slice program, also what each kind sends across slices ("<kind> across slices").

  Each collective counts as often as the program runs it: in a while loop's body (a scanned
  layer stack), as many times as its condition's bound. One collective may appear in several
  computations (TPU's async collective fusions copy it): its channel_id counts it once.
  """
  found: dict[str, tuple[str, int, int]] = {}  # channel (or line) -> (key, bytes, runs).
  computations, entry = _computations(hlo_text)
  for name, runs in _runs(computations, entry).items():
    for index, line in enumerate(computations[name]):
      op, send = _OP.search(line), _DCN_SEND.search(line)
      if op:
        key, result = op.group(2), op.group(1)
        elements = _tuple_elements(result)
        # An async start's result is (operands, outputs, ...); all-reduce-start's, the outputs.
        if op.group(3) and key != "all-reduce" and len(elements) > 1:
          result = elements[1]
      elif send:  # (payload, u32[], token[]).
        key = f"{_DCN_KINDS.get(send.group(2), send.group(2).lower())} across slices"
        result = _tuple_elements(f"({send.group(1)})")[0]
      else:
        continue
      channel = re.search(r"channel_id=(\d+)", line)
      identity = f"{key} {channel.group(1)}" if channel else f"{name} {index}"
      earlier = found.get(identity, (key, 0, 0))
      found[identity] = (key, max(earlier[1], _array_bytes(result)), max(earlier[2], runs))
  totals = {kind: 0 for kind in COLLECTIVES}
  for key, size, runs in found.values():
    totals[key] = totals.get(key, 0) + size * runs
  return totals


_HEADER = re.compile(r"^(ENTRY\s+)?%([^\s(]+)\s*\(.*\{\s*$")
_CALLEE = re.compile(r"\b(calls|to_apply|body|condition)=%([^\s,)}]+)")
_LOOP_BOUND = re.compile(r"s32\[\](?:\{[^}]*\})? constant\((\d+)\)")
_CALLEES = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], Optional[str]]:
  """The HLO module's computations (name -> instruction lines) and the entry's name."""
  computations, entry, current = {}, None, None
  for line in hlo_text.splitlines():
    header = _HEADER.match(line)
    if header:
      current = header.group(2)
      computations[current] = []
      entry = current if header.group(1) else entry
    elif line.rstrip() == "}":  # Not "}}, ...": a Pallas kernel's config spans lines.
      current = None
    elif current is not None:
      computations[current].append(line)
  return computations, entry


def _runs(computations: dict[str, list[str]], entry: Optional[str]) -> dict[str, int]:
  """How many times a step runs each computation reached from the entry (all once, if the
  text has no entry)."""
  if entry is None:
    return {name: 1 for name in computations}
  runs: dict[str, int] = {}

  def visit(name: str, times: int) -> None:
    runs[name] = runs.get(name, 0) + times
    for line in computations.get(name, ()):
      calls = _CALLEE.findall(line)
      callees = [callee for _, callee in calls]
      for group in _CALLEES.findall(line):
        callees += [c.strip().lstrip("%") for c in group.split(",") if c.strip()]
      trips = 1
      condition = dict(calls).get("condition")
      if condition:  # A while loop: its body runs up to its condition's bound.
        bound = _LOOP_BOUND.search("\n".join(computations.get(condition, ())))
        trips = int(bound.group(1)) if bound else 1
      for callee in callees:
        if callee in computations:
          visit(callee, times * (trips if callee == dict(calls).get("body") else 1))

  visit(entry, 1)
  return runs


def _costs(compiled, chip_count: int) -> Costs:
  analysis = compiled.cost_analysis()
  analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
  return Costs(flops=float(analysis.get("flops", 0.0)) * chip_count,
               optimal_seconds=float(analysis.get("optimal_seconds", 0.0)))


def _steps(run: settings.RunConfig, partitioner: partitioning.Partitioner,
           preference: bool) -> step.ShardedSteps:
  """The step as the run trains it; `preference`: by DPO, with its reference model."""
  return step.build(run, partitioner, eos_id=0 if run.data.document_masking else None,
                    preference=preference)


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
               compiled, preference: bool = False) -> Costs:
  """The compiler's costs of the step; for scanned layers, whose loop body it counts once,
  extrapolated from unrolled compiles of 2 and 4 layers."""
  chip_count = partitioner.mesh.size
  if not run.model.compute.scan_layers:
    return _costs(compiled, chip_count)
  unrolled = []
  for depth in (2, 4):
    model = dataclasses.replace(common.with_compute(run.model, scan_layers=False),
                                num_layers=depth)
    logging.info("Compiling %d unrolled layers to count the scanned step's costs", depth)
    shallow_run = dataclasses.replace(run, model=model)
    shallow = _compile(shallow_run, partitioner, _steps(shallow_run, partitioner, preference))
    unrolled.append(_costs(shallow, chip_count))
  return unrolled[0].scaled(unrolled[1], (run.model.num_layers - 2) / 2)


def plan(run: settings.RunConfig, topology_name: str, num_slices: int = 1,
         compiler_costs: bool = True, preference: bool = False) -> dict[str, Any]:
  """Compiles the run's train step for the topology; the plan's figures, JSON-ready.

  compiler_costs: also the compiler's FLOPs and bound (two more compiles for scanned layers);
  else those are None for scanned layers. preference: the step as DPO trains it (preference
  data decides that in training), its reference model held and run forward too.
  """
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
  if run.trainer.batch_size == "auto":
    run = dataclasses.replace(run, trainer=batch_search.resolve(run, partitioner, capacity,
                                                                preference=preference))
  trainer = run.trainer
  partitioner.check_batch_size(trainer.batch_size, trainer.gradient_accumulation_steps)
  logging.info("Compiling the train step for %s x %d (%d chips), batch %d", topology_name,
               num_slices, len(target), trainer.batch_size)
  steps = _steps(run, partitioner, preference)
  tokens = trainer.batch_size * run.model.seq_len
  result = {
      "topology": topology_name,
      "num_slices": num_slices,
      "chips": len(target),
      "device_kind": target[0].device_kind,
      "mesh": dict(mesh.shape),
      "batch_size": trainer.batch_size,
      "gradient_accumulation_steps": trainer.gradient_accumulation_steps,
      "objective": "dpo" if preference else "next-token",
      "hbm_per_chip_bytes": capacity,
      "tokens_per_step": tokens,
      "model_flops_per_step": tokens * steps.flops_per_token(run.model),
  }
  planned = {**result, **_memory_and_costs(run, partitioner, steps, capacity, compiler_costs)}
  if not planned["fits"]:
    # Whether any batch fits: the step of one sequence per data-parallel device, no accumulation.
    planned["smallest_step_bytes_per_chip"] = batch_search.step_bytes(run, partitioner, 1,
                                                                      preference=preference)
  return planned


def _memory_and_costs(run: settings.RunConfig, partitioner: partitioning.Partitioner,
                      steps: step.ShardedSteps, capacity: int,
                      compiler_costs: bool) -> dict[str, Any]:
  """The compiled step's memory per chip, whether it fits a chip of `capacity` bytes, and its
  costs."""
  try:
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
  costs = (step_costs(run, partitioner, compiled, steps.preference)
           if compiler_costs or not run.model.compute.scan_layers else None)
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


def describe(result: dict[str, Any]) -> str:
  """The plan as lines for a terminal."""
  gib = lambda n: f"{n / GIB:.2f} GiB"
  margin = result["hbm_per_chip_bytes"] - result["bytes_per_chip"]
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
      f"model FLOPs per step {result['model_flops_per_step']:.4g}",
  ]
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
  return "\n".join(lines)


def main(argv):
  if len(argv) > 1:
    exit_with_error(f"unexpected arguments: {' '.join(argv[1:])}")
  try:
    run = run_config_of_flags()
    result = plan(run, flags.FLAGS.topology, flags.FLAGS.num_slices, flags.FLAGS.compiler_costs,
                  flags.FLAGS.dpo)
  except UserError as e:
    exit_with_error(str(e))
  print(describe(result))
  if flags.FLAGS.output:
    try:
      with open(flags.FLAGS.output, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    except OSError as e:
      exit_with_error(f"--output={flags.FLAGS.output}: cannot write it: {e.strerror or e}")
  if not result["fits"]:
    short = (result["bytes_per_chip"] - result["hbm_per_chip_bytes"]) / GIB
    exit_with_error(f"the step needs {short:.2f} GiB per chip more than {result['topology']}'s "
                    f"HBM; {advice(run, result)}")


if __name__ == "__main__":  # Its flags only then: bench/tpu_plan.py imports this module.
  define_config_flag("A config file, or a shipped config's name (gpt2_nano, gpt2:nano).")
  flags.DEFINE_string("topology", None, "The TPU slice to compile for: a Cloud TPU name or "
                      f"jax's, e.g. {_EXAMPLES}.")
  flags.DEFINE_integer("num_slices", 1, "Slices, joined by the data-center network.")
  flags.DEFINE_string("output", None, "Also write the plan to this JSON file.")
  flags.DEFINE_bool("dpo", False, "Plan the step as DPO trains it, with its reference model "
                    "(in training, preference data decides; aot reads no data).")
  flags.DEFINE_bool("compiler_costs", True, "Also the compiler's FLOPs and bound; for scanned "
                    "layers, two more compiles (2 and 4 layers unrolled), as long as the first")
  flags.mark_flags_as_required(["config", "topology"])
  app.run(main, flags_parser=parse_flags)
