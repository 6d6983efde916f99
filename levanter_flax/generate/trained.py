"""A trained run read back for use (sampling, evaluation, serving, export, lf.load): its model
config and saved config.json, and the params of its newest readable checkpoint, on the host;
or an HF checkpoint directory's (model_directory, model_and_tokenizer)."""
from typing import Any

from absl import logging
from etils import epath

from levanter_flax import config
from levanter_flax.checkpoint import store
from levanter_flax.core import paths
from levanter_flax.core.errors import UserError
from levanter_flax.hf import snapshot
from levanter_flax.models import lora


def run_params(workdir: epath.Path) -> tuple[Any, Any, dict]:
  """(model config, params of the newest readable checkpoint, saved config.json) of a workdir.

  A damaged checkpoint is skipped with a warning, and left where it is.
  """
  model_cfg, saved, steps = run_checkpoints(workdir)
  for step in steps:
    path = workdir / "checkpoints" / str(step)
    try:
      params = store.restore_to_host(path / "state", "params")
    except Exception as e:  # pylint: disable=broad-except  # orbax and tensorstore raise many kinds.
      verdict = store.classified(e, path)
      if isinstance(verdict, UserError):
        raise verdict from None
      logging.warning("Checkpoint %s is damaged (%s); using the one before it", path, verdict)
      continue
    if model_cfg.lora.rank:  # The adapters, on the base the run saved when it started.
      try:
        params = lora.merged(store.restore_to_host(workdir / store.FROZEN_BASE), params)
      except Exception as e:  # pylint: disable=broad-except  # orbax, tensorstore: many kinds.
        raise UserError(f"cannot read {workdir / store.FROZEN_BASE}, the frozen base model of this "
                        f"LoRA run: {store.first_line(e)}") from None
    return model_cfg, params, saved
  raise UserError(f"every checkpoint in {workdir}/checkpoints ({steps}) is damaged")


def run_checkpoints(workdir: epath.Path) -> tuple[Any, dict, list[int]]:
  """(model config, saved config.json, checkpoint steps newest first) of a workdir, read without
  a checkpoint's arrays: what run_params checks before reading any, in a moment."""
  try:
    saved = config.read_saved(workdir)
  except OSError as e:
    raise UserError(f"cannot read {workdir / 'config.json'}: {e}") from None
  except ValueError as e:
    raise UserError(f"{workdir / 'config.json'} does not describe a model this version can "
                    f"build: {e}") from None
  if saved is None:
    raise UserError(f"{workdir} has no config.json: not a levanter_flax workdir")
  try:
    model_cfg = config.model_from_saved(saved)
  except UserError as e:
    raise UserError(f"{workdir / 'config.json'} does not describe a model this version can "
                    f"build: {e}") from None
  steps = sorted((int(p.name) for p in (workdir / "checkpoints").glob("*") if p.name.isdigit()),
                 reverse=True)
  if not steps:
    raise UserError(f"{workdir}/checkpoints holds no checkpoint")
  return model_cfg, saved, steps


def run_tokenizer(workdir: epath.Path, saved: dict):
  """The tokenizer a run trained with: config.json's data.tokenizer, if it is still the file
  its datasets were tokenized with (each manifest records it; the trainer refused any other);
  its generations end at its EOS too (tokenizers.ending_documents).

  A file replaced since would encode prompts into ids the model did not learn.
  """
  from levanter_flax.data import manifest, tokenizers  # pylint: disable=g-import-not-at-top
  spec = saved.get("data.tokenizer")
  if not isinstance(spec, str):
    raise UserError(f"{workdir}/config.json names no data.tokenizer to encode prompts with")
  tokenizer = tokenizers.load_tokenizer(spec)
  now = tokenizers.identity(tokenizer)
  for directory, prepared in _run_manifests(saved, f"check tokenizer {spec} against"):
    trained = manifest.manifest_tokenizer(prepared)
    if not trained.matches(now):
      raise UserError(f"tokenizer {spec} is {now.describe()} (vocab {now.vocab_size}), but the "
                      f"run in {workdir} trained on {directory}, tokenized with "
                      f"{trained.describe()} (vocab {trained.vocab_size}): the file changed "
                      f"since; put back the one the run trained with")
  return tokenizers.ending_documents(tokenizer)


def _run_manifests(saved: dict, purpose: str):
  """(directory, manifest) of each dataset of a run's config.json that can still be read; one
  moved or deleted since is logged (`purpose`: what is left undone), not an error."""
  from levanter_flax.data import manifest  # pylint: disable=g-import-not-at-top
  entries = saved.get("data.mixture") or [("train", saved.get("data.dataset"), 1.0)]
  for dataset in (dataset for _, dataset, _ in entries if isinstance(dataset, str)):
    try:
      directory = _directory(saved, dataset)
      prepared = manifest.load_manifest(directory)
    except UserError as e:
      logging.warning("Cannot %s the run's dataset %s: %s", purpose, dataset, e)
      continue
    yield directory, prepared


def chat_template(saved: dict, tokenizer, template_file: str):
  """The template --chat renders with: --chat_template, else the one the run's chat datasets
  were prepared with (their manifests record it), else the run's tokenizer's own."""
  from levanter_flax.data import chat  # pylint: disable=g-import-not-at-top
  spec = saved["data.tokenizer"]
  if tokenizer.kind != "huggingface":
    raise UserError(f"--chat needs a Hugging Face tokenizer.json with a chat template and an "
                    f"end-of-turn token; the run's data.tokenizer is {spec!r} ({tokenizer.kind})")
  if template_file:
    return chat.load_template(spec, template_file)
  return (trained_chat_template(saved, tokenizer)
          or chat.load_template(spec, ""))


def trained_chat_template(saved: dict, tokenizer):
  """The template the run's chat datasets were prepared with (their manifests record it, and
  its file must still hold it); None for a run on no chat data."""
  from levanter_flax.data import chat  # pylint: disable=g-import-not-at-top
  recorded = [chat.recorded_template(saved["data.tokenizer"], prepared["chat_template"],
                                     str(directory))
              for directory, prepared in _run_manifests(saved, "read the chat template of")
              if "chat_template" in prepared]
  if len({template.sha256 for template in recorded}) > 1:
    raise UserError(f"the run's chat datasets were prepared with different chat templates "
                    f"({', '.join(t.origin for t in recorded)}); pass --chat_template=FILE")
  return recorded[0] if recorded else None


def _directory(saved: dict, dataset: str) -> epath.Path:
  """Where a dataset of a run's config.json (data.dataset, or one of data.mixture) is."""
  from levanter_flax.data import dataset_writer  # pylint: disable=g-import-not-at-top
  if dataset == "stdlib":
    return dataset_writer.builtin_directory(saved["data.cache_dir"], saved["data.tokenizer"],
                                            saved["data.validation_fraction"],
                                            saved["data.num_train_shards"])
  return paths.resolve(dataset, "data.dataset of the run's config.json")


def model_directory(workdir: str, hf_dir: str) -> epath.Path:
  """The run's workdir or the HF checkpoint directory (exactly one of the two given), checked
  as far as it can be without reading the weights: known bad before the tasks load."""
  if bool(workdir) == bool(hf_dir):
    raise UserError("give --workdir (a training run) or --init_from_hf (a Hugging Face "
                    "checkpoint directory), not both or neither")
  if workdir:
    directory = paths.resolve(workdir, "--workdir")
    run_checkpoints(directory)
    return directory
  directory = paths.resolve(hf_dir, "--init_from_hf")
  for name, holds in (("config.json", "the model's shape"),
                      ("tokenizer.json", "the tokenizer")):
    if not (directory / name).exists():
      raise UserError(f"--init_from_hf {directory} holds no {name} ({holds})")
  return directory


def model_and_tokenizer(directory: epath.Path, is_run: bool):
  """(model config, host params, tokenizer) of a run's newest usable checkpoint or of an HF
  checkpoint directory (model_directory's)."""
  from levanter_flax.data import tokenizers  # pylint: disable=g-import-not-at-top
  if is_run:
    model_cfg, params, saved = run_params(directory)
    return model_cfg, params, run_tokenizer(directory, saved)
  model_cfg, params = snapshot.load(directory)
  return model_cfg, params, tokenizers.load_tokenizer(str(directory / "tokenizer.json"))
