r"""lm-eval-harness tasks on a run's newest checkpoint, or on a Hugging Face checkpoint.

    python -m levanter_flax.evaluate --workdir=runs/llama_nano --tasks=hellaswag,arc_easy \
        [--limit=100] [--num_fewshot=0] [--output=results.json] [--batch_size=8]
    python -m levanter_flax.evaluate --init_from_hf=/models/Qwen2-0.5B --tasks=my_task \
        --include_path=my_tasks/

Tasks are lm-eval's built-in names, whose datasets must already be on disk (a hub cache;
HF_DATASETS_OFFLINE=1 keeps it from reaching the network), or tasks of a directory of task
YAMLs (--include_path), e.g. over local JSON lines (dataset_path: json). Each task is loaded
before the model is: an unknown one, or one whose data is missing, is one line naming it.
The model is the run's (its tokenizer checked against its datasets, as sample.py checks it), or
the directory's config.json, safetensors and tokenizer.json; its batches run data-parallel
over every device. Prints lm-eval's results table; --output writes its results as JSON.
"""
import json

import jax
from absl import app, flags
from etils import epath

from levanter_flax.parallel import backend, partitioning
from levanter_flax.generate import trained
from levanter_flax.core import cli, paths
from levanter_flax.hf import snapshot
from levanter_flax import models
from levanter_flax.core.errors import UserError, exit_with_error


def lm_eval_harness():
  """harness.py, which needs lm-eval (an extra): its absence is one line."""
  try:
    from levanter_flax.eval import harness  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise UserError(f"lm-eval-harness is not installed ({e}): pip install -e \".[eval]\"") from None
  return harness


def model_directory(workdir: str, hf_dir: str) -> epath.Path:
  """The run's workdir or the HF checkpoint directory (exactly one of the two given), checked
  as far as it can be without reading the weights: known bad before the tasks load."""
  if bool(workdir) == bool(hf_dir):
    raise UserError("give --workdir (a training run) or --init_from_hf (a Hugging Face "
                    "checkpoint directory), not both or neither")
  if workdir:
    directory = paths.resolve(workdir, "--workdir")
    trained.run_checkpoints(directory)
    return directory
  directory = paths.resolve(hf_dir, "--init_from_hf")
  for name, holds in (("config.json", "the model's shape"),
                      ("tokenizer.json", "the tokenizer to encode the tasks with")):
    if not (directory / name).exists():
      raise UserError(f"--init_from_hf {directory} holds no {name} ({holds})")
  return directory


def model_and_tokenizer(directory: epath.Path, is_run: bool):
  """(model config, host params, tokenizer) of a run's newest usable checkpoint or of an HF
  checkpoint directory (model_directory's)."""
  from levanter_flax.data import tokenizers  # pylint: disable=g-import-not-at-top
  if is_run:
    model_cfg, params, saved = trained.run_params(directory)
    return model_cfg, params, trained.run_tokenizer(directory, saved)
  model_cfg, params = snapshot.load(directory)
  return model_cfg, params, tokenizers.load_tokenizer(str(directory / "tokenizer.json"))


def evaluate(model_cfg, params, tokenizer, names: list[str], manager, *, batch_size: int,
             limit: int | float | None, num_fewshot: int | None, max_gen_toks: int) -> dict:
  """lm-eval's results for `names`, the batches data-parallel over every device."""
  harness = lm_eval_harness()
  if jax.process_count() > 1:
    raise UserError("levanter_flax.evaluate runs on one process; run it on one host")
  mesh = partitioning.make_mesh((("data", -1), ("model", 1)))
  partitioner = partitioning.Partitioner(
      mesh, partitioning.ShardingConfig(rules=models.family(model_cfg).partition_rules))
  with partitioner.activation_context():
    lm = harness.LevanterLM(model_cfg, params, tokenizer,
                            param_shardings=partitioner.param_shardings(params),
                            batch_sharding=partitioner.batch_sharding(), batch_size=batch_size,
                            max_gen_toks=max_gen_toks)
    return harness.evaluate(lm, names, manager, limit=limit, num_fewshot=num_fewshot)


def write_results(results: dict, output: epath.Path) -> None:
  from lm_eval.utils import handle_non_serializable  # pylint: disable=g-import-not-at-top
  text = json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)
  try:
    paths.write_atomically(output, text)
  except OSError as e:
    raise UserError(f"cannot write --output {output}: {e.strerror or e}") from None


def document_limit(limit: float | None) -> int | float | None:
  """--limit as lm-eval takes it: a count of documents per task, or below 1 a fraction of them."""
  if limit is None or limit < 1:
    return limit
  if limit != int(limit):
    raise UserError(f"--limit must be a number of documents (a whole number) or a fraction "
                    f"below 1 of them; got {limit}")
  return int(limit)


def main(argv: list[str]) -> None:
  del argv
  flag = flags.FLAGS
  cli.quiet_orbax()
  backend.skip_absent_tpu()
  try:
    harness = lm_eval_harness()
    names = harness.task_names(flag.tasks, "--tasks")
    directory = model_directory(flag.workdir, flag.init_from_hf)
    output = paths.resolve(flag.output, "--output") if flag.output else None
    if output is not None:  # Known writable before minutes of evaluation.
      if output.is_dir():
        raise UserError(f"--output {output} is a directory; give a file name")
      paths.probe_writable(output, "--output")
    include_path = ""
    if flag.include_path:
      include_path = str(paths.resolve(flag.include_path, "--include_path"))
      if not epath.Path(include_path).is_dir():
        raise UserError(f"--include_path {flag.include_path} is not a directory of task YAMLs")
    manager = harness.load_tasks(names, include_path)  # Before the model: minutes, for a large one.
    model_cfg, params, tokenizer = model_and_tokenizer(directory, is_run=bool(flag.workdir))
    results = evaluate(model_cfg, params, tokenizer, names, manager, batch_size=flag.batch_size,
                       limit=document_limit(flag.limit), num_fewshot=flag.num_fewshot,
                       max_gen_toks=flag.max_gen_toks)
    if output is not None:
      write_results(results, output)
  except UserError as e:
    exit_with_error(str(e))
  print(harness.table(results))
  if output is not None:
    print(f"Wrote the results to {flag.output}")


if __name__ == "__main__":
  flags.DEFINE_string("workdir", None, "A training run's workdir: its newest usable checkpoint.")
  flags.DEFINE_string("init_from_hf", None, "Or a Hugging Face checkpoint directory (config.json, "
                      "safetensors, tokenizer.json).")
  flags.DEFINE_string("tasks", None, "lm-eval task, group or tag names, comma-separated.",
                      required=True)
  flags.DEFINE_string("include_path", None, "A directory of lm-eval task YAMLs, whose tasks "
                      "--tasks may name besides the built-in ones.")
  flags.DEFINE_float("limit", None, "Evaluate at most this many documents per task; below 1, "
                     "this fraction of them.", lower_bound=0)
  flags.register_validator("limit", lambda limit: limit is None or limit > 0,
                           "--limit must be above 0")
  flags.DEFINE_integer("num_fewshot", None, "Few-shot examples per prompt (default: each task's "
                       "own).", lower_bound=0)
  flags.DEFINE_string("output", None, "Write lm-eval's results as JSON to this file.")
  flags.DEFINE_integer("batch_size", 8, "Requests per batch (rounded up to a multiple of the "
                       "devices).", lower_bound=1)
  flags.DEFINE_integer("max_gen_toks", 256, "Tokens a generation task "  # lm-eval's default.
                       "that sets no max_gen_toks may generate.", lower_bound=1)
  app.run(main, flags_parser=cli.parse_flags)
