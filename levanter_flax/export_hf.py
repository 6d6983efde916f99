r"""Writes a run's newest checkpoint as a Hugging Face checkpoint (config.json + model.safetensors).

    python -m levanter_flax.export_hf --workdir=runs/llama_nano --output_dir=/tmp/llama_nano_hf

transformers then loads it with AutoModelForCausalLM.from_pretrained(output_dir).
"""
import pathlib

from absl import app, flags

from levanter_flax import hf
from levanter_flax.checkpoint import run_params
from levanter_flax.errors import UserError, exit_with_error


def main(argv: list[str]) -> None:
  del argv
  try:
    model_cfg, params, _ = run_params(pathlib.Path(flags.FLAGS.workdir))
    hf.save(model_cfg, params, flags.FLAGS.output_dir)
  except UserError as e:
    exit_with_error(str(e))
  print(f"Wrote {model_cfg.architecture} to {flags.FLAGS.output_dir}")


if __name__ == "__main__":
  flags.DEFINE_string("workdir", None, "A training run's workdir.", required=True)
  flags.DEFINE_string("output_dir", None, "Where config.json and model.safetensors go.",
                      required=True)
  app.run(main)
