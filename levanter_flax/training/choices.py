"""What a run's start chooses, and checks of its choice against its data and devices.

A run chooses some settings when it first starts (schema.CHOSEN): the batch for
trainer.batch_size "auto" (batch_search) and the reader groups for data.reader_groups 0
(position.default_reader_groups). config.json keeps the choice, and a resume keeps it from
there by config.keep_chosen, the rule the launcher applies too (launch/local.py), so a resumed
run reads the batches it would have read uninterrupted, whatever it would choose now. The data
chooses the objective (objective_name): config.rl.prompts trains by GRPO, preference data by
DPO.
"""
import dataclasses
from typing import Callable, Optional

import jax
from absl import logging
from etils import epath

from levanter_flax import config
from levanter_flax.config.settings import RunConfig, TrainerConfig
from levanter_flax.core.errors import UserError
from levanter_flax.data.manifest import PreparedDataset
from levanter_flax.data.position import default_reader_groups
from levanter_flax.models import pipeline
from levanter_flax.parallel import partitioning


def objective_name(run: RunConfig, sources: list[PreparedDataset]) -> str:
  """What the run trains by (objectives.OBJECTIVES): "grpo" if config.rl names prompts (and
  then it reads no datasets); "dpo" if its datasets are preference data, all or none, each pair
  one row of config.model.seq_len, read with document masking; else "next_token"."""
  if run.rl.prompts:
    return "grpo"
  pairs = [s for s in sources if s.preference_seq_len]
  if not pairs:
    return "next_token"
  if len(pairs) < len(sources):
    others = [s.name for s in sources if not s.preference_seq_len]
    names = ", ".join(s.name for s in pairs)
    raise UserError(f"config.data.mixture mixes preference data ({names}) with other data "
                    f"({', '.join(others)}): a DPO run trains on preference pairs alone")
  for source in pairs:
    if source.preference_seq_len != run.model.seq_len:
      raise UserError(f"dataset {source.directory} holds preference pairs in rows of "
                      f"{source.preference_seq_len} tokens (prepare --seq_len), but "
                      f"config.model.seq_len is {run.model.seq_len}: they must be equal")
  if not run.data.document_masking:
    raise UserError("config.data.document_masking must be True for preference data (DPO): the "
                    "rejected reply must not attend to the chosen one in its row")
  return "dpo"


def batch(run: RunConfig, kept: dict, saved: Optional[dict],
          search: Callable[[], TrainerConfig], workdir: epath.Path) -> TrainerConfig:
  """The trainer with its batch: as set; for "auto", searched (`search`) when the run first
  starts, else as config.json keeps it (`kept`: config.keep_chosen's), never searched again."""
  trainer = run.trainer
  if trainer.batch_size != "auto":
    return trainer
  if kept["trainer.batch_size"] == "auto":  # The run's first start.
    trainer = search()
  else:
    trainer = dataclasses.replace(
        trainer, batch_size=kept["trainer.batch_size"],
        gradient_accumulation_steps=kept["trainer.gradient_accumulation_steps"])
    _warn_if_search_changed(saved, kept, trainer, workdir)
  logging.info("batch_size 'auto': %d sequences per step in %d microbatches",
               trainer.batch_size, trainer.gradient_accumulation_steps)
  return trainer


def _warn_if_search_changed(saved: dict, kept: dict, trainer: TrainerConfig,
                            workdir: epath.Path) -> None:
  """One warning when config.batch_search changed since the kept batch was chosen."""
  changed = config.changes(saved, kept, [k for k in kept if k.startswith("batch_search.")])
  if changed:
    logging.warning("Keeping the batch the run in %s chose when it started, trainer.batch_size "
                    "%d and gradient_accumulation_steps %d: config.batch_search changed (%s), "
                    "but a resume does not search again; use a new --workdir for a new search",
                    workdir, trainer.batch_size, trainer.gradient_accumulation_steps,
                    ", ".join(changed))


def check_batch_size(trainer: TrainerConfig, partitioner: partitioning.Partitioner,
                     processes: int | None = None) -> None:
  """The batch splits over the mesh, the pipeline's microbatches and `processes` (default:
  this run's)."""
  partitioner.check_batch_size(trainer.batch_size, trainer.gradient_accumulation_steps)
  schedule = pipeline.schedule_of(trainer.pipeline,
                                  partitioner.logical_axis_size(pipeline.LAYERS))
  pipeline.check_batch(schedule, trainer.batch_size // trainer.gradient_accumulation_steps,
                       partitioner.data_parallel_size)
  processes = processes or jax.process_count()
  if (trainer.batch_size // trainer.gradient_accumulation_steps) % processes:
    raise UserError(f"config.trainer.batch_size ({trainer.batch_size}) / "
                    f"gradient_accumulation_steps ({trainer.gradient_accumulation_steps}) "
                    f"must be divisible by the process count ({processes})")


def check_vocab(source: PreparedDataset, vocab_size: int) -> None:
  needed = source.manifest["tokenizer"]["vocab_size"]
  if vocab_size < needed:
    raise UserError(f"config.model.vocab_size ({vocab_size}) is smaller than the vocabulary of "
                    f"the tokenizer ({needed}) that {source.directory} was prepared with")


def reader_group_count(run: RunConfig, kept: int, saved: Optional[dict], batch_size: int,
                       sources: list[PreparedDataset], workdir: epath.Path) -> int:
  """data.reader_groups as the run first started with it: the batches depend on it.

  A new run takes config.data.reader_groups, or the default for its batch
  size and datasets; config.json then keeps it (`kept`: config.keep_chosen's)
  for every resume.
  """
  asked, started = run.data.reader_groups, (saved or {}).get("data.reader_groups", 0)
  if asked and started and asked != started:
    raise UserError(f"config.data.reader_groups is {asked}, but the run in {workdir} started "
                    f"with {started}: its batches would change; leave the key unset to resume, "
                    f"or use a new --workdir")
  if saved is not None and not kept:  # An older version: one per process.
    logging.warning("The run in %s saved no reader-group count (an older version read one per "
                    "process); resuming with %d, the same stream only if it ran on %d processes",
                    workdir, jax.process_count(), jax.process_count())
    return jax.process_count()
  return kept or default_reader_groups(batch_size, jax.process_count(), sources,
                                       run.model.seq_len)
