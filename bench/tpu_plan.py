"""The TPU compiler's figures for the shipped large configs and for the seven techniques.

    python bench/tpu_plan.py [--rows=targets,techniques] [--results=FILE.json] [--write_docs]

Each row is `aot`'s plan (levanter_flax.plan): the trainer's step compiled by libtpu for a TPU
topology on this machine. Memory per chip and the counts are the compiled program's; the
compiler's bound (`optimal_seconds`) is its idealized cost model, a relative signal between
rows on the same libtpu, never a step time. Nothing runs on a TPU.

Rows already in --results are kept (those that failed are tried again), so an interrupted
run goes on where it stopped;
--write_docs puts the tables into docs/Performance-Guide.md between its tpu_plan markers.
"""
import json
import pathlib
import sys
import time

from absl import app, flags

from levanter_flax.plan import planner
from levanter_flax.plan.slices import HBM_BYTES, devices as slice_devices
from levanter_flax.training import batch_search
from levanter_flax.parallel import partitioning
from levanter_flax.config import load_config_file, to_run_config
from levanter_flax.core.errors import UserError

REPO = pathlib.Path(__file__).resolve().parent.parent
GUIDE = REPO / "docs" / "Performance-Guide.md"
BEGIN, END = "<!-- tpu_plan:begin -->", "<!-- tpu_plan:end -->"
GIB = 1 << 30

# Two slices: plain data parallelism across them (a "replica" axis over the data-center
# network), ZeRO-3 and tensor parallelism inside each, so that only the gradients' reduction
# crosses slices; one sequence per data-parallel rank, accumulated to the config's 256.
MULTI_SLICE = {"trainer.device_mesh": {"replica": 1, "data": -1, "model": 8},
               "trainer.dcn_mesh": {"replica": -1}, "sharding.activation_axis": "replica,data",
               "trainer.gradient_accumulation_steps": 4}
# The shipped large configs on the slices they are meant for: (config, topology, slices, changes).
TARGETS = [("gpt2.py:small", "v5e-8", 1, {}), ("llama.py:1b", "v5e-16", 1, {}),
           ("llama.py:7b", "v5p-64", 1, {}), ("mistral.py:7b", "v5p-64", 1, {}),
           ("mixtral.py:8x7b", "v5p-128", 1, {}), ("qwen3_moe.py:30b_a3b", "v5p-64", 1, {}),
           ("deepseek_v3.py:671b", "v5p-512", 1, {}),
           ("llama.py:7b", "v5e-256", 2, MULTI_SLICE)]

# Llama-2-7B on v5p-64 (32 chips), one 4096-token sequence per chip, full remat, parameters
# and optimizer state split over all 32 chips (ZeRO-3 on a 1D mesh): the case and layout of
# MaxText's own compile (7.8 GiB per chip, 175.6 TFLOP per chip per step). XLA's attention,
# so that each row changes one thing against it; splash has its own rows.
BASE = {"trainer.batch_size": 32, "trainer.gradient_accumulation_steps": 1,
        "trainer.device_mesh": {"data": 32, "model": 1}, "model.compute.attention_impl": "xla"}
# 32k-token sequences, 4 a step: context parallelism splits each over 8 chips.
LONG = {"model.seq_len": 32768, "trainer.batch_size": 4, "model.compute.attention_impl": "splash"}
# Each technique switched one way and the other on BASE: (technique, setting, overrides).
TECHNIQUES = [
    ("baseline (1D mesh data=32, ZeRO-3, full remat, XLA attention)", "", {}),
    ("1. device mesh", "2D: data=4 x model=8 (the config's)",
     {"trainer.device_mesh": {"data": 4, "model": 8}}),
    ("2. ZeRO-3", "off: sharding.parameter_axis=None, optimizer_axis=None",
     {"sharding.parameter_axis": None, "sharding.optimizer_axis": None}),
    ("3. batch and accumulation", "batch 256 in 8 microbatches",
     {"trainer.batch_size": 256, "trainer.gradient_accumulation_steps": 8}),
    ("5. remat", "dots_with_no_batch_dims_saveable",
     {"model.compute.remat": "dots_with_no_batch_dims_saveable"}),
    ("5. remat", "none", {"model.compute.remat": "none"}),
    ("attention", "splash, sequence 4096 (MaxText's case)",
     {"model.compute.attention_impl": "splash"}),
    ("attention", "xla, sequence 8192", {"model.seq_len": 8192}),
    ("attention", "splash, sequence 8192",
     {"model.seq_len": 8192, "model.compute.attention_impl": "splash"}),
    ("context parallelism", "sequence 32768, splash, data=4 x model=8 (heads split, not the "
     "sequence)", {**LONG, "trainer.device_mesh": {"data": 4, "model": 8}}),
    ("context parallelism", "sequence 32768, splash, data=4 x sequence=8",
     {**LONG, "trainer.device_mesh": {"data": 4, "sequence": 8, "model": 1},
      "sharding.parameter_axis": "data,sequence", "sharding.optimizer_axis": "data,sequence",
      "sharding.logical_axis_rules": (("length", "sequence"),)}),
]

_ROWS = flags.DEFINE_list("rows", ["targets", "techniques"], "Which tables to compute.")
_RESULTS = flags.DEFINE_string("results", str(REPO / "bench" / "tpu_plan.json"),
                               "Rows computed so far; kept, and added to.")
_WRITE_DOCS = flags.DEFINE_bool("write_docs", False, "Write the tables into the guide.")
_COMPILER_COSTS = flags.DEFINE_bool(
    "compiler_costs", True, "The compiler's FLOPs and bound too: for a scanned stack, two more "
    "compiles a row (aot --compiler_costs)")


def run_of(config: str, overrides: dict):
  node_config = load_config_file(str(REPO / "configs" / config))
  for key, value in overrides.items():
    *sections, name = key.split(".")
    node = node_config
    for section in sections:
      node = node[section]
    node[name] = value
  return to_run_config(node_config)


def largest_batch(config: str, topology: str, num_slices: int, overrides: dict, row: dict) -> int:
  """The largest global batch, without accumulation, whose step fits the chip's HBM: the
  config's microbatch doubled while it fits (halved while it does not); memory-only compiles."""
  run = run_of(config, overrides)
  devices = slice_devices(topology, num_slices)
  mesh = partitioning.make_mesh(run.trainer.device_mesh, devices, run.trainer.dcn_mesh)
  partitioner = partitioning.Partitioner(mesh, run.sharding)
  capacity = HBM_BYTES[devices[0].device_kind]
  fits = lambda n: batch_search.step_bytes(run, partitioner, n) <= capacity
  per_rank = max(1, row["batch_size"] // row["gradient_accumulation_steps"]
                 // partitioner.data_parallel_size)
  if fits(per_rank):
    while per_rank < 1024 and fits(2 * per_rank):
      per_rank *= 2
  else:
    while per_rank > 0 and not fits(per_rank):
      per_rank //= 2
  return per_rank * partitioner.data_parallel_size


def compute(key: str, config: str, topology: str, num_slices: int, overrides: dict) -> dict:
  start = time.time()
  try:
    row = planner.plan(run_of(config, overrides), topology, num_slices, _COMPILER_COSTS.value)
  except UserError as e:
    row = {"error": str(e)}
  row["seconds"] = round(time.time() - start)
  print(key, json.dumps(row), flush=True)
  return row


def gib(n) -> str:
  return "—" if n is None else f"{n / GIB:.2f}"


def collectives(row: dict) -> str:
  found = row.get("collective_bytes_per_step") or {}
  return ", ".join(f"{k} {v / GIB:.2f}" for k, v in found.items() if v) or "—"


def bound(row: dict) -> str:
  seconds = row.get("compiler_bound_seconds")
  return "—" if seconds is None else f"{seconds:.3f}"


def table(header: list[str], rows: list[tuple[list[str], dict]], cells) -> list[str]:
  """A markdown table: per row, its labels, then cells(result) or why there is none."""
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  for labels, row in rows:
    if row is None or "error" in row:
      why = row["error"].replace(f"{REPO}/", "") if row else "not computed"
      values = [why] + [""] * (len(header) - len(labels) - 1)
    else:
      values = cells(row)
    lines.append("| " + " | ".join(labels + values) + " |")
  return lines


def fits(row: dict) -> str:
  return "yes" if row["fits"] else "NO"


def targets_table(results: dict) -> list[str]:
  return table(
      ["config", "target", "HBM per chip (GiB needed / of)", "fits", "largest batch that fits",
       "collective GiB per chip per step", "compiler's bound (s)"],
      [([config, topology + (f" × {slices}" if slices > 1 else "")],
        results.get(f"target {config} {topology} {slices}"))
       for config, topology, slices, _ in TARGETS],
      lambda row: [f"{gib(row['bytes_per_chip'])} / {gib(row['hbm_per_chip_bytes'])}", fits(row),
                   str(row.get("largest_batch", "—")), collectives(row), bound(row)])


def techniques_table(results: dict) -> list[str]:
  return table(
      ["technique", "setting", "HBM per chip (GiB)", "temporaries (GiB)", "fits",
       "model TFLOP per chip", "collective GiB per chip per step", "compiler's bound (s)"],
      [([name, setting], results.get(f"technique {name} {setting}"))
       for name, setting, _ in TECHNIQUES],
      lambda row: [gib(row["bytes_per_chip"]), gib(row["temp_bytes_per_chip"]), fits(row),
                   f"{row['model_flops_per_step'] / row['chips'] / 1e12:.1f}", collectives(row),
                   bound(row)])


def write_docs(results: dict) -> None:
  text = GUIDE.read_text()
  if BEGIN not in text or END not in text:
    sys.exit(f"{GUIDE} has no {BEGIN} ... {END} section")
  table = "\n".join([
      "The TPU compiler's figures (libtpu 0.0.42, compiled on a CPU machine by "
      "`python bench/tpu_plan.py`), not measurements on a TPU. The bound is the compiler's "
      "idealized `optimal_seconds`: compare it between rows, never read it as a step time; "
      "— where it was not computed (`--nocompiler_costs`, for a scanned stack) or is not "
      "positive. The largest batch is without accumulation, the config's microbatch doubled "
      "(or halved) per data-parallel rank while it fits; a step that does not fit was refused "
      "by the compiler, its memory from the compiler's message.",
      "", "Shipped configs on their targets:", "", *targets_table(results), "",
      "The techniques on llama_7b (Llama-2-7B's shape) on v5p-64 (32 chips), one 4096-token "
      "sequence per chip, each row one change against the baseline:", "",
      *techniques_table(results)])
  head, rest = text.split(BEGIN, 1)
  GUIDE.write_text(f"{head}{BEGIN}\n{table}\n{END}{rest.split(END, 1)[1]}")


# The order rows are computed in: the goals' rows first (a run may be cut short).
FIRST = [TECHNIQUES[0][0], "splash, sequence 4096 (MaxText's case)", "xla, sequence 8192",
         "splash, sequence 8192"]


def main(argv):
  del argv
  path = pathlib.Path(_RESULTS.value)
  results = json.loads(path.read_text()) if path.exists() else {}
  techniques = sorted(TECHNIQUES, key=lambda t: not (t[0] in FIRST or t[1] in FIRST))  # Stable.
  work = []
  if "techniques" in _ROWS.value:
    work += [(f"technique {name} {setting}", "llama.py:7b", "v5p-64", 1,
              {**BASE, **overrides}) for name, setting, overrides in techniques]
  if "targets" in _ROWS.value:  # After the goals' techniques.
    first = sum(1 for name, setting, _ in techniques if name in FIRST or setting in FIRST)
    work[first:first] = [(f"target {c} {t} {s}", c, t, s, o) for c, t, s, o in TARGETS]
  for key, *job in work:
    if key not in results or "error" in results[key]:  # An error may be fixed since.
      earlier, results[key] = results.get(key, {}), compute(key, *job)
      for figure in ("compiler_flops_per_step", "compiler_bound_seconds"):
        if results[key].get(figure) is None and earlier.get(figure) is not None:
          results[key][figure] = earlier[figure]  # From a run with --compiler_costs.
      path.write_text(json.dumps(results, indent=1))
  if "targets" in _ROWS.value:
    for config, topology, slices, overrides in TARGETS:
      row = results[f"target {config} {topology} {slices}"]
      if "error" not in row and "largest_batch" not in row:
        row["largest_batch"] = largest_batch(config, topology, slices, overrides, row)
        print(config, topology, "largest batch", row["largest_batch"], flush=True)
        path.write_text(json.dumps(results, indent=1))
  if _WRITE_DOCS.value:
    write_docs(results)


if __name__ == "__main__":
  app.run(main)
