"""The fit plan before launch: the run's train step compiled for a TPU topology, on any machine.

    levanter-flax aot --config=configs/llama_7b.py --topology=v5p-64 \\
        [--num_slices=2] [--config.x=y ...] [--output=plan.json]

libtpu (`pip install -e ".[tpu-aot]"`) compiles for TPU chips that are not there: jax's
compile-only devices of the topology (plan/ says what is compiled and counted). It prints the
memory per chip and whether the step fits, FLOPs and collective bytes per step; a step that does
not fit ends in one line naming what to try. Nothing here touches a TPU, the network or the
workdir; TensorFlow is never imported.
"""
import json

from absl import app, flags

from levanter_flax import objectives
from levanter_flax.config import define_config_flag, parse_flags, run_config_of_flags
from levanter_flax.core.errors import UserError, exit_with_error
from levanter_flax.plan import planner, slices
from levanter_flax.plan.slices import EXAMPLES, GIB


define_config_flag("A config file, or a shipped config's name (gpt2_nano, gpt2:nano).")
flags.DEFINE_string("topology", None, "The TPU slice to compile for: a Cloud TPU name or "
                    f"jax's, e.g. {EXAMPLES}.")
flags.DEFINE_integer("num_slices", 1, "Slices, joined by the data-center network.")
flags.DEFINE_string("output", None, "Also write the plan to this JSON file.")
flags.DEFINE_enum("objective", "next_token", list(objectives.OBJECTIVES),
                  "Plan the step as this objective trains it: its batch, and its reference model "
                  "for dpo, or grpo with config.rl.beta > 0 (in training, the data decides; aot "
                  "reads no data).")
flags.DEFINE_bool("compiler_costs", True, "Also the compiler's FLOPs and bound; for scanned "
                  "layers, two more compiles (2 and 4 layers unrolled; pipelined, 1 and 2 layers "
                  "a stage, the pipeline's loops unrolled)")
flags.mark_flags_as_required(["config", "topology"])


def main(argv):
  if len(argv) > 1:
    exit_with_error(f"unexpected arguments: {' '.join(argv[1:])}")
  try:
    # The flags first: a mistyped topology is said before the config or libtpu loads.
    slices.topology(flags.FLAGS.topology)
    if flags.FLAGS.num_slices < 1:
      raise UserError(f"--num_slices must be at least 1; got {flags.FLAGS.num_slices}")
    run = run_config_of_flags()
    result = planner.plan(run, flags.FLAGS.topology, flags.FLAGS.num_slices,
                          flags.FLAGS.compiler_costs, flags.FLAGS.objective)
  except UserError as e:
    exit_with_error(str(e))
  print(planner.describe(result))
  if flags.FLAGS.output:
    try:
      with open(flags.FLAGS.output, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    except OSError as e:
      exit_with_error(f"--output={flags.FLAGS.output}: cannot write it: {e.strerror or e}")
  if not result["fits"]:
    short = (planner.needed_per_chip(result) - result["hbm_per_chip_bytes"]) / GIB
    exit_with_error(f"the step needs {short:.2f} GiB per chip more than {result['topology']}'s "
                    f"HBM; {planner.advice(run, result)}")


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
