r"""Writes a run's newest checkpoint as a Hugging Face checkpoint (config.json + model.safetensors).

    python -m levanter_flax.export_hf --workdir=runs/llama_nano --output_dir=/tmp/llama_nano_hf

transformers then loads it with AutoModelForCausalLM.from_pretrained(output_dir). A non-empty
output directory is refused unless --overwrite is given; a training run's workdir never is one.
A LoRA run (config.model.lora.rank > 0) is exported with --merge_lora (the model with the
adapters merged into its weights, the same format) or --adapter (a PEFT adapter:
peft.PeftModel.from_pretrained(base, output_dir)).
"""
import json
import os

import numpy as np
from absl import app, flags
from etils import epath

from levanter_flax import cli, hf, models, paths
from levanter_flax.checkpoint import run_params
from levanter_flax.errors import UserError, exit_with_error
from levanter_flax.models import lora

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


def merge_lora(model_cfg, params, workdir: epath.Path, merge: bool, adapter: bool):
  """(model config, params) to write as an HF checkpoint: a LoRA run's merged (--merge_lora);
  the flags refused where they do not fit the run."""
  rank = model_cfg.lora.rank
  if merge and adapter:
    raise UserError("pass --merge_lora or --adapter, not both")
  if (merge or adapter) and not rank:
    raise UserError(f"--{'adapter' if adapter else 'merge_lora'}: the run in {workdir} has no "
                    f"LoRA adapters (config.model.lora.rank is 0)")
  if rank and not (merge or adapter):
    raise UserError(f"the run in {workdir} trains LoRA adapters (config.model.lora.rank {rank}): "
                    f"pass --merge_lora for the merged model or --adapter for a PEFT adapter")
  return lora.merge_into_base(model_cfg, params) if merge else (model_cfg, params)


def write_adapter(model_cfg, params, saved: dict, output_dir: epath.Path) -> None:
  """A PEFT LoRA adapter: adapter_config.json and adapter_model.safetensors, each targeted
  module's lora_A [rank, in] and lora_B [rank, out] under peft's names, which HF's tensor names
  give (base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight)."""
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  if model_cfg.compute.scan_layers:
    params = models.unstack_layers(model_cfg, params)
  names = models.family(model_cfg).hf.tensor_names(model_cfg)
  tensors, modules = {}, set()
  for module, (a, b) in lora.adapters_of(params).items():
    path = names[f"{module}/kernel"][0].removesuffix(".weight")
    for name, matrix in (("lora_A", a), ("lora_B", b)):  # peft's are Linear weights: [out, in].
      tensors[f"base_model.model.{path}.{name}.weight"] = np.ascontiguousarray(
          np.asarray(matrix, np.float32).T)
    modules.add(".".join(path.split(".")[-2:]))  # Every layer alike: attn.c_attn, mlp.up_proj.
  adapter_config = {
      "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": model_cfg.lora.rank,
      "lora_alpha": model_cfg.lora.alpha, "lora_dropout": model_cfg.lora.dropout,
      "target_modules": sorted(modules), "bias": "none", "use_rslora": False,
      "fan_in_fan_out": model_cfg.architecture == "gpt2",  # GPT-2's Conv1D weights are [in, out].
      "base_model_name_or_path": saved.get("trainer.init_from_hf") or None,
      "inference_mode": True}
  paths.make_dirs(output_dir, "output directory")
  try:
    with paths.staged(output_dir) as local:
      save_file(tensors, str(local / "adapter_model.safetensors"), metadata={"format": "pt"})
      (local / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
      for name in ("adapter_model.safetensors", "adapter_config.json"):
        os.chmod(local / name, 0o644)
  except OSError as e:
    raise UserError(f"cannot write the adapter into {output_dir}: {e.strerror or e}") from None


def main(argv: list[str]) -> None:
  del argv
  flag = flags.FLAGS
  cli.quiet_orbax()
  try:
    output_dir = paths.resolve(flag.output_dir, "--output_dir")
    workdir = paths.resolve(flag.workdir, "--workdir")
    check_output_dir(output_dir, workdir, flag.overwrite)
    model_cfg, params, saved = run_params(workdir)
    model_cfg, params = merge_lora(model_cfg, params, workdir, flag.merge_lora, flag.adapter)
    remove_stale_weights(output_dir)  # Only once there is something to write instead.
    if flag.adapter:
      write_adapter(model_cfg, params, saved, output_dir)
    else:
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
  flags.DEFINE_bool("merge_lora", False, "A LoRA run: write the model with its adapters merged "
                    "into the weights (W + A B alpha / rank).")
  flags.DEFINE_bool("adapter", False, "A LoRA run: write its adapters as a PEFT adapter "
                    "(adapter_config.json + adapter_model.safetensors) instead of a model.")
  app.run(main, flags_parser=cli.parse_flags)
