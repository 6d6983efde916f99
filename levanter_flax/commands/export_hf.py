r"""Writes a run's newest checkpoint as a Hugging Face checkpoint that stands alone.

    levanter-flax export-hf --workdir=runs/llama_nano --output_dir=/tmp/llama_nano_hf \
        [--dtype=bfloat16] [--max_shard_size=5GB]

The weights (in the run's model.compute.param_dtype unless --dtype says otherwise; over
--max_shard_size in shards with their index), config.json and generation_config.json with the
token ids, and the run's tokenizer (the tokenizer.json its datasets were tokenized with, and the
tokenizer_config.json beside it, else a minimal one), so that transformers' from_pretrained,
AutoTokenizer and pipeline("text-generation") need nothing else. A non-empty output directory
is refused unless --overwrite is given; a training run's workdir never is one.
A LoRA run (config.model.lora.rank > 0) is exported with --merge_lora (the model with the
adapters merged into its weights, the same format) or --adapter (a PEFT adapter:
peft.PeftModel.from_pretrained(base, output_dir)).
"""
from absl import app, flags

from levanter_flax.core import cli, paths
from levanter_flax.core.errors import UserError, exit_with_error
from levanter_flax.generate.export import (check_output_dir, merge_lora, parse_size,
                                           remove_stale_files, tokenizer_files, write_adapter)
from levanter_flax.generate.trained import run_params
from levanter_flax.hf import snapshot
from levanter_flax.parallel import backend


def main(argv: list[str]) -> None:
  del argv
  flag = flags.FLAGS
  cli.quiet_orbax()
  try:
    backend.open_devices()
    output_dir = paths.resolve(flag.output_dir, "--output_dir")
    workdir = paths.resolve(flag.workdir, "--workdir")
    check_output_dir(output_dir, workdir, flag.overwrite)
    max_shard_size = parse_size(flag.max_shard_size, "--max_shard_size")
    if flag.adapter and flag["max_shard_size"].present:
      raise UserError("--max_shard_size shards a model's weights; an --adapter is one file")
    model_cfg, params, saved = run_params(workdir)
    model_cfg, params = merge_lora(model_cfg, params, workdir, flag.merge_lora, flag.adapter)
    dtype = flag.dtype or model_cfg.compute.param_dtype
    if flag.adapter:
      remove_stale_files(output_dir)
      write_adapter(model_cfg, params, saved, output_dir, dtype)
    else:
      files, token_ids = tokenizer_files(workdir, saved, model_cfg.seq_len)
      remove_stale_files(output_dir)  # Only once there is something to write instead.
      snapshot.save(model_cfg, params, output_dir, dtype=dtype, max_shard_size=max_shard_size,
                    token_ids=token_ids, files=files)
  except UserError as e:
    exit_with_error(str(e))
  what = "its LoRA adapter" if flag.adapter else model_cfg.architecture
  print(f"Wrote {what} to {flag.output_dir}")


if __name__ == "__main__":
  flags.DEFINE_string("workdir", None, "A training run's workdir.", required=True)
  flags.DEFINE_string("output_dir", None, "Where config.json and model.safetensors go.",
                      required=True)
  flags.DEFINE_bool("overwrite", False, "Replace the config.json, *.safetensors and tokenizer "
                    "files of a non-empty --output_dir (its other files stay).")
  flags.DEFINE_enum("dtype", None, snapshot.DTYPES, "The weights' dtype; default: the run's "
                    "model.compute.param_dtype.")
  flags.DEFINE_string("max_shard_size", "5GB", "Larger weights are written in shards of at most "
                      "this size, as transformers does: 5GB, 500MB, 2GiB or bytes.")
  flags.DEFINE_bool("merge_lora", False, "A LoRA run: write the model with its adapters merged "
                    "into the weights (W + A B alpha / rank).")
  flags.DEFINE_bool("adapter", False, "A LoRA run: write its adapters as a PEFT adapter "
                    "(adapter_config.json + adapter_model.safetensors) instead of a model.")
  app.run(main, flags_parser=cli.parse_flags)
