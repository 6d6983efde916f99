r"""lm-eval-harness tasks on a run's newest checkpoint, or on a Hugging Face checkpoint.

    levanter-flax evaluate --workdir=runs/llama_nano --tasks=hellaswag,arc_easy \
        [--limit=100] [--num_fewshot=0] [--output=results.json] [--batch_size=8]
    levanter-flax evaluate --init_from_hf=/models/Qwen2-0.5B --tasks=my_task \
        --include_path=my_tasks/

Tasks are lm-eval's built-in names, whose datasets must already be on disk (a hub cache;
HF_DATASETS_OFFLINE=1 keeps it from reaching the network), or tasks of a directory of task
YAMLs (--include_path), e.g. over local JSON lines (dataset_path: json). Each task is loaded
before the model is: an unknown one, or one whose data is missing, is one line naming it.
The model is the run's (its tokenizer checked against its datasets, as sample.py checks it), or
the directory's config.json, safetensors and tokenizer.json; its batches run data-parallel
over every device. Prints lm-eval's results table; --output writes its results as JSON.
"""
from absl import app, flags
from etils import epath

from levanter_flax.core import cli, paths
from levanter_flax.core.errors import UserError, exit_with_error
from levanter_flax.eval.tasks import document_limit, evaluate, lm_eval_harness, write_results
from levanter_flax.generate.trained import model_and_tokenizer, model_directory
from levanter_flax.parallel import backend


def main(argv: list[str]) -> None:
  del argv
  flag = flags.FLAGS
  cli.quiet_orbax()
  try:
    backend.open_devices()
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
