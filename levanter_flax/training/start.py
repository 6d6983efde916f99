"""A run's start, decided before anything is restored: `resolve` reads the config.json a resume
must match, makes the start's choices (choices.py), checks the resume (resume_checks.py), and
returns the run as it trains. state.py then restores or builds the state it trains from.
"""
import dataclasses
import functools
from typing import Optional

import jax
from etils import epath

from levanter_flax import config, objectives
from levanter_flax.checkpoint.store import Checkpointer
from levanter_flax.config.settings import RunConfig
from levanter_flax.data import eval_set, loader
from levanter_flax.data.manifest import PreparedDataset
from levanter_flax.data.position import ReaderGroups
from levanter_flax.objectives.base import Objective
from levanter_flax.parallel import partitioning
from levanter_flax.training import batch_search, choices, resume_checks, rollouts


@dataclasses.dataclass(frozen=True)
class Start:
  """The run as it trains, resolved once, and what its loop reads besides the state."""
  run: RunConfig  # With what its start chose: a batch size, never "auto"; reader groups, never 0.
  sources: list[PreparedDataset]
  eos_id: Optional[int]  # The token that ends a document, for data.document_masking; else None.
  reader_groups: ReaderGroups  # This process's.
  config_changes: list[str]  # "key old -> new" against config.json, named if a restore fails.
  objective: Objective  # What it trains by: its data decides (choices.objective_name).
  prompts: Optional[rollouts.RunPrompts] = None  # What an objective that reads rollouts samples.


def resolve(run: RunConfig, workdir: epath.Path, partitioner: partitioning.Partitioner,
            checkpointer: Checkpointer) -> Start:
  """`run` as it trains in `workdir`: what its start chose, kept from config.json on a resume;
  its datasets. A resume that config.json refuses stops here, before anything is restored."""
  saved = resume_checks.saved_config(workdir, checkpointer, run.checkpoint.resume_without_config)
  kept = config.keep_chosen(config.flat_dict(run), saved)
  # GRPO trains on what it samples from its prompts (config.rl), not on datasets.
  sources = [] if run.rl.prompts else loader.load_datasets(run.data)
  if sources:
    choices.check_vocab(sources[0], run.model.vocab_size)
  objective = objectives.of_run(choices.objective_name(run, sources), run,
                                loss_weights=loader.has_loss_weights(sources))
  prompts = rollouts.read_prompts(run) if objective.reads == "rollouts" else None
  # The step the search compiles is the one the run trains: DPO's reference, the loss weights.
  search = functools.partial(batch_search.resolve, run, partitioner, objective=objective)
  trainer = choices.batch(run, kept, saved, search, workdir)
  choices.check_batch_size(trainer, partitioner)
  if prompts is not None:  # Whole groups; said before anything is restored or built.
    rollouts.check_batch_size(trainer.batch_size, run.rl.group_size)
  for source in sources:  # A split too small to evaluate: said now, not after the first steps.
    if source.has_validation:
      eval_set.num_windows(source, run.model.seq_len, trainer.eval_tokens)
  count = choices.reader_group_count(run, kept["data.reader_groups"], saved, trainer.batch_size,
                                     sources, workdir)
  run = dataclasses.replace(run, trainer=trainer,
                            data=dataclasses.replace(run.data, reader_groups=count))
  groups = ReaderGroups.of_process(count, jax.process_index(), jax.process_count())
  # This process count and batch size must fit them: said before anything is restored.
  groups.rows_per_group(trainer.batch_size // jax.process_count(), "config.trainer.batch_size")
  config_changes = resume_checks.check_resumed_config(run, saved, workdir)
  eos_id = (sources[0].manifest["tokenizer"]["eos_id"] if sources and run.data.document_masking
            else None)
  return Start(run, sources, eos_id, groups, config_changes, objective, prompts)


