r"""Writes a run's newest checkpoint as a Hugging Face checkpoint (config.json + model.safetensors).

    python -m levanter_flax.export_hf --workdir=runs/llama_nano --output_dir=/tmp/llama_nano_hf

transformers then loads it with AutoModelForCausalLM.from_pretrained(output_dir). A non-empty
output directory is refused unless --overwrite is given; a training run's workdir never is one.
"""
from absl import app, flags
from etils import epath

from levanter_flax import cli, hf, paths
from levanter_flax.checkpoint import run_params
from levanter_flax.errors import UserError, exit_with_error

# What a previous export (or another HF checkpoint) leaves that hf.load would also read.
_STALE = ("*.safetensors", "*.safetensors.index.json")


def check_output_dir(output_dir: epath.Path, workdir: epath.Path, overwrite: bool) -> None:
  """Refuses an output directory that would mix with a run's files or another checkpoint's."""
  output, run = paths.real(output_dir), paths.real(workdir)
  if output == run or run in output.parents:
    raise UserError(f"--output_dir {output_dir} is inside the training run's --workdir {workdir}; "
                    f"export somewhere else")
  if (output / "config.json").is_file() and (output / "checkpoints").is_dir():
    raise UserError(f"--output_dir {output_dir} holds a training run (config.json and "
                    f"checkpoints/); export somewhere else")
  if output.exists() and not output.is_dir():
    raise UserError(f"--output_dir {output_dir} exists and is not a directory")
  if output.is_dir() and any(output.iterdir()) and not overwrite:
    raise UserError(f"--output_dir {output_dir} is not empty; pass --overwrite to replace its "
                    f"config.json and *.safetensors")


def remove_stale_weights(output_dir: epath.Path) -> None:
  """Deletes old weight files first, so that no shard of another export stays beside ours."""
  for pattern in _STALE:
    for path in output_dir.glob(pattern):
      try:
        path.unlink()
      except OSError as e:
        raise UserError(f"cannot remove the old {path}: {e.strerror or e}") from None


def main(argv: list[str]) -> None:
  del argv
  flag = flags.FLAGS
  cli.quiet_orbax()
  try:
    output_dir = paths.resolve(flag.output_dir, "--output_dir")
    workdir = paths.resolve(flag.workdir, "--workdir")
    check_output_dir(output_dir, workdir, flag.overwrite)
    model_cfg, params, _ = run_params(workdir)
    remove_stale_weights(output_dir)  # Only once there is something to write instead.
    hf.save(model_cfg, params, output_dir)
  except UserError as e:
    exit_with_error(str(e))
  print(f"Wrote {model_cfg.architecture} to {flag.output_dir}")


if __name__ == "__main__":
  flags.DEFINE_string("workdir", None, "A training run's workdir.", required=True)
  flags.DEFINE_string("output_dir", None, "Where config.json and model.safetensors go.",
                      required=True)
  flags.DEFINE_bool("overwrite", False, "Replace the config.json and *.safetensors of a "
                    "non-empty --output_dir (its other files stay).")
  app.run(main, flags_parser=cli.parse_flags)
