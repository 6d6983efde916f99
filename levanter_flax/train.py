"""The training loop: build or restore the state, run steps, log, eval, checkpoint."""
import os
import pathlib

import jax
import numpy as np
from absl import logging
from clu import periodic_actions

from levanter_flax import metrics, optim, partitioning, step
from levanter_flax.checkpoint import Checkpointer, abstract_like
from levanter_flax.config import RunConfig
from levanter_flax.data import loader, prepare
from levanter_flax.errors import UserError
from levanter_flax.models.gpt2 import GPT2LMHeadModel


def _make_workdir(workdir: pathlib.Path) -> pathlib.Path:
  try:
    workdir.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise UserError(f"cannot create workdir {workdir}: {e.strerror or e}") from e
  if not os.access(workdir, os.W_OK):
    raise UserError(f"workdir {workdir} is not writable")
  return workdir


def _check_batch_size(batch_size: int, partitioner: partitioning.Partitioner) -> None:
  for divisor, what in ((partitioner.data_parallel_size, "the activation axis size"),
                        (jax.process_count(), "the process count")):
    if batch_size % divisor:
      raise UserError(f"config.trainer.batch_size ({batch_size}) must be divisible by "
                      f"{what} ({divisor})")


def _check_vocab(manifest: dict, vocab_size: int, data_dir: pathlib.Path) -> None:
  needed = manifest["tokenizer"]["vocab_size"]
  if vocab_size < needed:
    raise UserError(f"config.model.vocab_size ({vocab_size}) is smaller than the vocabulary of "
                    f"tokenizer {manifest['tokenizer']['name']!r} ({needed}) in {data_dir}")


def _mean(history: list[dict]) -> dict[str, float]:
  history = jax.device_get(history)
  return {k: float(np.mean([m[k] for m in history])) for k in history[0]}


def train_and_evaluate(run: RunConfig, workdir: pathlib.Path) -> dict[str, float]:
  """Trains to run.trainer.num_train_steps, resuming from workdir; returns the last metrics."""
  trainer = run.trainer
  workdir = _make_workdir(workdir)
  mesh = partitioning.make_mesh(trainer.device_mesh)
  partitioner = partitioning.Partitioner(mesh, run.sharding)
  _check_batch_size(trainer.batch_size, partitioner)
  data_dir = prepare.prepare(run.data)
  manifest = prepare.load_manifest(data_dir)
  _check_vocab(manifest, run.model.vocab_size, data_dir)

  model = GPT2LMHeadModel(run.model)
  schedule = optim.learning_rate_schedule(run.optimizer, trainer.num_train_steps)
  optimizer = optim.make_optimizer(run.optimizer, schedule)
  steps = step.build_sharded_steps(model, optimizer, schedule, partitioner, run.model.seq_len)
  num_params = sum(x.size for x in jax.tree.leaves(steps.abstract_state.params))
  logging.info("Model: %s, %s parameters; mesh %s", run.model, f"{num_params:,}", dict(mesh.shape))
  logging.info("Parameter layout:\n%s", steps.layout_table())

  checkpointer = Checkpointer(workdir / "checkpoints", trainer.keep_checkpoints)
  with partitioner.activation_context():
    if checkpointer.latest_step is not None:
      logging.info("Resuming from checkpoint at step %d in %s", checkpointer.latest_step, workdir)
      state = checkpointer.restore_latest(abstract_like(steps.abstract_state, steps.state_shardings))
    else:
      state = steps.init(jax.random.key(trainer.seed))
    final_metrics = _train_loop(run, workdir, steps, state, checkpointer, data_dir, manifest)
  checkpointer.close()
  return final_metrics


def _train_loop(run: RunConfig, workdir: pathlib.Path, steps: step.ShardedSteps,
                state: step.TrainState, checkpointer: Checkpointer, data_dir: pathlib.Path,
                manifest: dict) -> dict[str, float]:
  trainer = run.trainer
  start_step = int(state.step)
  local_batch_size = trainer.batch_size // jax.process_count()
  data_args = dict(seq_len=run.model.seq_len, local_batch_size=local_batch_size,
                   process_index=jax.process_index(), process_count=jax.process_count())
  train_batches = loader.global_batches(
      loader.train_dataset(data_dir, manifest, seed=trainer.seed,
                           shuffle_buffer_size=run.data.shuffle_buffer_size,
                           start_batch=start_step, **data_args),
      steps.batch_sharding)
  eval_data = loader.eval_dataset(data_dir, manifest, num_batches=trainer.eval_batches, **data_args)

  def evaluate(params) -> dict[str, float]:
    losses = [steps.eval_step(params, batch)
              for batch in loader.global_batches(eval_data, steps.batch_sharding)]
    result = _mean(losses)
    result["eval/perplexity"] = float(np.exp(result["eval/loss"]))
    return result

  writer = metrics.create_writer(workdir)
  report_progress = periodic_actions.ReportProgress(
      num_train_steps=trainer.num_train_steps, writer=writer, every_steps=trainer.log_every_steps)
  throughput = metrics.Throughput(trainer.batch_size * run.model.seq_len, start_step)
  history, last_metrics = [], {}
  for step_num in range(start_step + 1, trainer.num_train_steps + 1):
    with jax.profiler.StepTraceAnnotation("train", step_num=step_num):
      state, step_metrics = steps.train_step(state, next(train_batches))
    history.append(step_metrics)
    if step_num == start_step + 1:
      # Leave compilation out of the throughput figures.
      jax.block_until_ready(step_metrics)
      throughput.reset(step_num)
    is_last = step_num == trainer.num_train_steps
    if step_num % trainer.log_every_steps == 0 or is_last:
      last_metrics = _mean(history) | throughput.measure(step_num)
      writer.write_scalars(step_num, last_metrics)
      history = []
    report_progress(step_num)
    if step_num % trainer.eval_every_steps == 0 or is_last:
      eval_metrics = evaluate(state.params)
      writer.write_scalars(step_num, eval_metrics)
      last_metrics |= eval_metrics
      throughput.reset(step_num)
    if step_num % trainer.checkpoint_every_steps == 0 or is_last:
      checkpointer.save(step_num, state)
  writer.close()
  return last_metrics
