"""A trained run as a Hugging Face checkpoint that stands alone, or as a PEFT adapter: its
tokenizer files and token ids, LoRA merged or written apart, the output directory checked and
cleared of what a previous export left. The export_hf command's library."""
import json
import os
import re
from typing import Any

import numpy as np
from absl import logging
from etils import epath

from levanter_flax import models
from levanter_flax.core import paths
from levanter_flax.core.errors import UserError
from levanter_flax.generate import trained
from levanter_flax.hf import snapshot
from levanter_flax.models import lora


# What a previous export (or another HF checkpoint) leaves that would mix with ours.
_STALE = ("*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
          "adapter_config.json", "tokenizer.json", "tokenizer_config.json",
          "special_tokens_map.json", "chat_template.jinja", "tokenizer.model")
# Beside a tokenizer.json, what AutoTokenizer reads with it: special tokens, the chat template.
_TOKENIZER_CONFIGS = ("tokenizer_config.json", "special_tokens_map.json")
# transformers' units of --max_shard_size (utils.hub.convert_file_size_to_int); a lower-case
# "b" in the decimal ones means bits.
_UNITS = {"GIB": 2**30, "MIB": 2**20, "KIB": 2**10, "GB": 10**9, "MB": 10**6, "KB": 10**3}


def parse_size(text: str, flag: str) -> int:
  """Bytes of a size as transformers writes them: "5GB", "500MB", "2GiB" or an int of bytes."""
  match = re.fullmatch(r"(\d+)([KMG]I?B)?", text.strip(), re.IGNORECASE)
  if not match or int(match[1]) <= 0:
    raise UserError(f"{flag}={text!r} is not a size: give a positive int of bytes or one with a "
                    f"unit, e.g. 5GB, 500MB, 2GiB")
  number, unit = int(match[1]), (match[2] or "")
  size = number * _UNITS.get(unit.upper(), 1)
  return size // 8 if unit.endswith("b") and not unit.upper().endswith("IB") else size


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


def remove_stale_files(output_dir: epath.Path) -> None:
  """Deletes old weight and tokenizer files first, so that none of another export's stays beside
  ours (a byte-tokenized run writes no tokenizer to replace them)."""
  for pattern in _STALE:
    for path in output_dir.glob(pattern):
      try:
        path.unlink()
      except OSError as e:
        raise UserError(f"cannot remove the old {path}: {e.strerror or e}") from None


def tokenizer_files(workdir: epath.Path, saved: dict, seq_len: int
                    ) -> tuple[dict[str, bytes], dict[str, Any]]:
  """(file name -> contents, token ids) of the run's tokenizer for AutoTokenizer: the
  tokenizer.json its datasets were tokenized with (trained.run_tokenizer checks it against their
  manifests), with the tokenizer_config.json beside it or else a minimal one.

  The EOS is the one that ended every training document. The run's documents each began after
  one, so without a tokenizer_config.json naming another it is the BOS too, as in GPT-2's.
  """
  import tokenizers  # pylint: disable=g-import-not-at-top
  tokenizer = trained.run_tokenizer(workdir, saved)
  if tokenizer.kind != "huggingface":
    logging.warning("The run's %s tokenizer (data.tokenizer=%s) is no tokenizer.json: no "
                    "tokenizer files written; give transformers one of your own", tokenizer.kind,
                    saved["data.tokenizer"])
    return {}, {"eos_token_id": tokenizer.eos_id}
  path = paths.resolve(saved["data.tokenizer"], "data.tokenizer")
  files = {"tokenizer.json": path.read_bytes()}
  vocab = tokenizers.Tokenizer.from_str(files["tokenizer.json"].decode())
  for name in _TOKENIZER_CONFIGS:
    if (path.parent / name).is_file():
      files[name] = (path.parent / name).read_bytes()
  if "tokenizer_config.json" in files:
    try:
      config = json.loads(files["tokenizer_config.json"])
    except ValueError as e:
      raise UserError(f"cannot read {path.parent / 'tokenizer_config.json'}: {e}") from None
    token_ids = {"eos_token_id": _eos_token_id(tokenizer),
                 "bos_token_id": _token_id(vocab, config.get("bos_token")),
                 "pad_token_id": _token_id(vocab, config.get("pad_token"))}
  else:
    eos = vocab.id_to_token(tokenizer.eos_id)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "bos_token": eos,
              "model_max_length": seq_len, "clean_up_tokenization_spaces": False}
    files["tokenizer_config.json"] = (json.dumps(config, indent=2) + "\n").encode()
    token_ids = {"eos_token_id": _eos_token_id(tokenizer), "bos_token_id": tokenizer.eos_id}
  # The template the chat data was rendered with, wherever prepare found it (--chat_template,
  # chat_template.jinja), goes inside tokenizer_config.json, where AutoTokenizer reads it.
  template = trained.trained_chat_template(saved, tokenizer)
  if template is not None and config.get("chat_template") != template.source:
    files["tokenizer_config.json"] = (json.dumps(config | {"chat_template": template.source},
                                                 indent=2) + "\n").encode()
  return files, token_ids


def _eos_token_id(tokenizer) -> int | list[int]:
  """What a generation of the export ends at: the EOS that ended every training document, and
  the ids its checkpoint's generation ended at (a chat template's end of turn, say)."""
  ids = list(dict.fromkeys([tokenizer.eos_id, *tokenizer.stop_ids]))
  return ids if len(ids) > 1 else ids[0]


def _token_id(vocab, token) -> int | None:
  """The id of a tokenizer_config.json's special token: a string, or an object with content."""
  token = token.get("content") if isinstance(token, dict) else token
  return vocab.token_to_id(token) if isinstance(token, str) else None


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


def write_adapter(model_cfg, params, saved: dict, output_dir: epath.Path, dtype: str) -> None:
  """A PEFT LoRA adapter: adapter_config.json and adapter_model.safetensors, each targeted
  module's lora_A [rank, in] and lora_B [rank, out] under peft's names, which HF's tensor names
  give (base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight), in `dtype`."""
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  if model_cfg.compute.scan_layers:
    params = models.unstack_layers(model_cfg, params)
  names = models.family(model_cfg).hf.tensor_names(model_cfg)
  tensors, modules = {}, set()
  for weight, (a, b) in lora.adapters_of(params).items():
    if not weight.endswith("/kernel"):
      raise UserError(f"--adapter: this run trains adapters on expert stacks ({weight}), which "
                      f"have no PEFT adapter form here; pass --merge_lora for the merged model")
    path = names[weight][0].removesuffix(".weight")
    for name, matrix in (("lora_A", a), ("lora_B", b)):  # peft's are Linear weights: [out, in].
      tensors[f"base_model.model.{path}.{name}.weight"] = np.ascontiguousarray(
          np.asarray(matrix).astype(snapshot.numpy_dtype(dtype)).T)
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
