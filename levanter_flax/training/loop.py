"""The training loop: run steps, log, eval, checkpoint; the start (start.py) gives it the run
as it trains and the state it starts from."""
import concurrent.futures
import contextlib
import dataclasses
import functools
import os
import time
from typing import Any, Sequence

import jax
import numpy as np
from absl import logging
from clu import periodic_actions
from etils import epath

from levanter_flax import config
from levanter_flax.training import (batch_search, callbacks as callbacks_lib, restore,
                                    resume_checks, rollouts, step)
from levanter_flax.training.start import Start, resolve
from levanter_flax.parallel import distributed, partitioning
from levanter_flax.core import flops, locks, paths
from levanter_flax.monitoring import metrics, watch
from levanter_flax.monitoring.history import RUN_START
from levanter_flax.checkpoint import preemption
from levanter_flax.optim import spikes
from levanter_flax.checkpoint.store import Checkpointer
from levanter_flax.config.settings import RunConfig, TrainerConfig
from levanter_flax.data import eval_set, loader
from levanter_flax.data.manifest import PreparedDataset
from levanter_flax.data.position import DataPosition
from levanter_flax.core.errors import UserError
from levanter_flax.models import common


def _check_backend(model) -> None:
  backend = jax.default_backend()
  if common.attention_implementation(model) == "cudnn" and backend != "gpu":
    raise UserError(f"config.model.compute.attention_impl 'cudnn' needs an NVIDIA GPU; "
                    f"this run's backend is {backend}")
  if model.compute.remat == "offload" and backend == "cpu":
    raise UserError("config.model.compute.remat 'offload' moves activations to host memory, "
                    "which needs a GPU or TPU; this run's backend is cpu")


def _use_compilation_cache(trainer) -> None:
  """Compiled steps persist across runs. What the config leaves unset, jax reads from
  $JAX_COMPILATION_CACHE_DIR and $JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS."""
  if trainer.jax_compilation_cache_dir:
    what = "config.trainer.jax_compilation_cache_dir"
    directory = paths.make_dirs(paths.resolve(trainer.jax_compilation_cache_dir, what), what)
    jax.config.update("jax_compilation_cache_dir", str(directory))
  if trainer.jax_persistent_cache_min_compile_time_secs != -1:
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      trainer.jax_persistent_cache_min_compile_time_secs)


# Steps dispatched ahead of the device at most: enough to hide the host's work and jitter,
# few enough that the batches and metrics they hold stay small.
_MAX_STEPS_AHEAD = 8


def _steps_running(history: list[dict]) -> int:
  """How many earlier steps the device is still computing: how far dispatch runs ahead.

  Steps finish in order, so it looks back from the newest to the first one done.
  """
  running = 0
  for step_metrics in reversed(history):
    if step_metrics["train/loss"].is_ready():
      break
    running += 1
  return running


# Counts since the run began: reported as of the interval's last step, not averaged.
_RUNNING_TOTALS = ("train/spike_skipped_steps",)


def _mean(history: list[dict]) -> dict[str, float]:
  history = jax.device_get(history)  # Never empty: callers check.
  return {k: float(history[-1][k] if k in _RUNNING_TOTALS else np.mean([m[k] for m in history]))
          for k in history[0]}


@dataclasses.dataclass(frozen=True)
class TrainResult:
  """How a run ended: its final state and its last metrics (the last log step's means and the
  last eval; {} for a run that had already finished, whose newest checkpoint `state` is)."""
  state: step.TrainState
  metrics: dict[str, float]

  @property
  def params(self) -> Any:
    """What the model applies (with LoRA: the adapters merged into the base), as checkpoint.
    run_params reads them back."""
    return self.state.model_params


def train_and_evaluate(run: RunConfig, workdir: epath.Path | str | os.PathLike,
                       callbacks: Sequence[callbacks_lib.Callback] = ()) -> dict[str, float]:
  """Trains to run.trainer.num_train_steps, resuming from workdir; returns the last metrics."""
  return run_training(run, workdir, callbacks).metrics


def run_training(run: RunConfig, workdir: epath.Path | str | os.PathLike,
                 callbacks: Sequence[callbacks_lib.Callback] = ()) -> TrainResult:
  """Trains to run.trainer.num_train_steps, resuming from workdir, calling each callback after
  every its every_steps-th step.

  The workdir is locked first: a second run in it is refused rather than
  merged with this one.
  """
  due_callbacks = callbacks_lib.Callbacks(callbacks)
  if not isinstance(workdir, epath.Path):  # A str or os.PathLike, as a user passes it.
    workdir = paths.resolve(workdir, "workdir")
  workdir = paths.make_dirs(workdir, "workdir")
  # The signal handlers span every attempt: a stop asked for while a rollback restarts the run
  # ends the attempt after it. They stay until the last save is written (the checkpointer
  # closes first): a second SIGTERM then waits too.
  with locks.locked_for_job(workdir, "workdir") as lock, preemption.StopSignal() as stop:
    while True:
      try:
        return _build_and_train(run, workdir, lock, stop, due_callbacks)
      except spikes.RollBack as rollback:  # Everything closed: start again as a resume does.
        spikes.roll_back(workdir, rollback, workdir / "checkpoints", run.trainer.max_rollbacks)


def _build_and_train(run: RunConfig, workdir: epath.Path, lock: locks.JobLock,
                     stop: preemption.StopSignal,
                     due_callbacks: callbacks_lib.Callbacks) -> TrainResult:
  _check_backend(run.model)
  _use_compilation_cache(run.trainer)
  mesh = partitioning.make_mesh(run.trainer.device_mesh, dcn_mesh=run.trainer.dcn_mesh)
  partitioner = partitioning.Partitioner(mesh, run.sharding)
  with contextlib.ExitStack() as opened:
    # Opened first: whether the workdir holds checkpoints decides what the start keeps.
    checkpointer = opened.enter_context(contextlib.closing(
        Checkpointer(workdir / "checkpoints", run.checkpoint, before_save=lock.check_all)))
    start = resolve(run, workdir, partitioner, checkpointer)
    steps = step.build(start.run, partitioner, start.eos_id, start.objective)
    num_params = sum(x.size for x in jax.tree.leaves(steps.abstract_state.model_params))
    logging.info("Model: %s, %s parameters; mesh %s", start.run.model, f"{num_params:,}",
                 dict(mesh.shape))
    logging.info("Parameter layout:\n%s", steps.layout_table())
    if steps.pipeline_schedule:
      logging.info("Pipeline: %s (trainer.pipeline)", steps.pipeline_schedule.describe())
    with partitioner.activation_context(), opened.pop_all():
      return _restore_and_train(start, workdir, steps, partitioner, checkpointer, stop, lock,
                                due_callbacks)


def _metric_writer(run: RunConfig, workdir: epath.Path, lock: locks.JobLock):
  """The run's metric writers, closed on leaving; its settings go with the scalars."""
  return contextlib.closing(metrics.create_writer(workdir, lock.may_write, config.flat_dict(run),
                                                  run.trainer.wandb))


def _restore_and_train(start: Start, workdir: epath.Path, steps: step.ShardedSteps,
                       partitioner: partitioning.Partitioner, checkpointer: Checkpointer,
                       stop: preemption.StopSignal, lock: locks.JobLock,
                       due_callbacks: callbacks_lib.Callbacks) -> TrainResult:
  run, trainer = start.run, start.run.trainer
  # Compiled while the state is restored or created and the input starts; not for a run
  # that looks finished, which only says so.
  compile_step = functools.partial(step.compile_in_background, steps, partitioner,
                                   trainer.batch_size)
  finished = (checkpointer.latest_step or 0) >= trainer.num_train_steps
  compiled_step = None if finished else compile_step()
  try:
    state, progress = restore.initial_state(start, workdir, steps, checkpointer)
    if int(state.step) >= trainer.num_train_steps:
      step_num = int(state.step)
      eval_missed = resume_checks.eval_missed(run, start.sources, workdir, checkpointer, step_num)
      harness_missed = resume_checks.harness_missed(run, workdir, checkpointer, step_num)
      if eval_missed or harness_missed:
        with _metric_writer(run, workdir, lock) as writer:
          if eval_missed:
            _evaluate_missed_step("eval", _make_evaluate(run, steps, start.sources), state,
                                  writer)
          if harness_missed:
            _evaluate_missed_step("harness", _harness_of_state(_make_harness(run, steps)), state,
                                  writer)
      logging.warning("Already finished: the newest checkpoint is step %d, and "
                      "config.trainer.num_train_steps is %d; raise it to train on",
                      int(state.step), trainer.num_train_steps)
      return TrainResult(state, {})
    resume_checks.save_config(run, workdir)
    compiled_step = compiled_step or compile_step()  # The newest checkpoint was unusable.
    return _train_loop(start, workdir, steps, state, progress, checkpointer, stop,
                       compiled_step, lock, due_callbacks)
  finally:
    # It cannot be cancelled: a run that stops early waits for it, so that nothing prints
    # after the run's last line and no compiler thread outlives the interpreter.
    if compiled_step:
      concurrent.futures.wait([compiled_step])


def _evaluate_missed_step(what: str, evaluate, state: step.TrainState, writer
                          ) -> dict[str, float]:
  """Runs `what` (the eval, the harness) that a stop lost at the restored step, and logs it."""
  step_num = int(state.step)
  logging.warning("Step %d's %s was not logged (the run stopped between its checkpoint and its "
                  "%s); running it now", step_num, what, what)
  eval_metrics = evaluate(state)
  writer.write_scalars(step_num, eval_metrics)
  return eval_metrics


def _make_evaluate(run: RunConfig, steps: step.ShardedSteps, sources: list[PreparedDataset]):
  """state -> eval/loss, its standard error, perplexity, bits per byte and the tokens scored,
  per source for a mixture. Each source's eval set is read now, before training. A source with
  loss weights scores its weighted tokens only, and has no bits per byte (its text bytes are
  the whole conversations'). Preference data (DPO): eval/loss is DPO's over the pairs, with
  the dpo/ metrics, eval/dpo/..., and the pairs scored."""
  evaluated = [s for s in sources if s.has_validation]
  if sources and not evaluated:
    logging.warning("No dataset has a validation split: no eval metrics")
  # Each process reads its own share: damage found in one is every process's error.
  eval_sets = distributed.agreed(lambda: [
      eval_set.build(source, seq_len=run.model.seq_len, eval_tokens=run.trainer.eval_tokens,
                     vocab_size=run.model.vocab_size, process_index=jax.process_index(),
                     process_count=jax.process_count()) for source in evaluated],
                                 "to read its share of the eval set")
  # Microbatch-sized: what fits in memory for training fits for eval.
  batch_size = run.trainer.batch_size // run.trainer.gradient_accumulation_steps

  def evaluate(state: step.TrainState) -> dict[str, float]:
    results, params = {}, steps.eval_params(state)
    for windows in eval_sets:
      prefix = "eval" if len(sources) == 1 else f"eval/{windows.source.name}"
      if steps.objective.reads == "pairs":
        means, stderr = eval_set.evaluate_pairs(windows, steps.eval_step, params, batch_size,
                                                steps.batch_sharding)
        results |= {f"{prefix}/{name}": value for name, value in means.items()}
        results |= {f"{prefix}/loss_stderr": stderr, f"{prefix}/pairs": float(windows.num_windows)}
        continue
      loss, stderr, tokens = eval_set.evaluate(windows, steps.eval_step, params, batch_size,
                                               steps.batch_sharding)
      results |= {f"{prefix}/loss": loss, f"{prefix}/loss_stderr": stderr,
                  f"{prefix}/perplexity": float(np.exp(loss)), f"{prefix}/tokens": tokens}
      if not windows.source.has_loss_weights:
        bits_per_byte = loss / np.log(2) * windows.source.validation_tokens_per_byte
        results[f"{prefix}/bits_per_byte"] = float(bits_per_byte)
    if len(sources) > 1 and evaluated:
      weights = [s.weight for s in evaluated]
      results["eval/loss"] = float(np.average([results[f"eval/{s.name}/loss"] for s in evaluated],
                                              weights=weights))
    return results
  return evaluate


def _make_harness(run: RunConfig, steps: step.ShardedSteps):
  """params -> harness/<task>/<metric> (lm-eval-harness, harness.py), or None when
  trainer.eval_harness_every_steps is 0. The tasks and their data are loaded now, so a wrong
  name or missing data stops the run before its first step, not hours later."""
  if not run.trainer.eval_harness_every_steps:
    return None
  try:
    from levanter_flax.eval import harness  # pylint: disable=g-import-not-at-top  # lm_eval: when used.
  except ImportError as e:
    raise UserError(f"config.trainer.eval_harness_every_steps needs lm-eval-harness, which is not "
                    f"installed ({e}): pip install -e \".[eval]\"") from None
  from levanter_flax.data import tokenizers  # pylint: disable=g-import-not-at-top
  tokenizer = tokenizers.ending_documents(tokenizers.load_tokenizer(run.data.tokenizer))
  return harness.InRun(run, tokenizer, steps.state_shardings.model_params, steps.batch_sharding)


def _harness_of_state(run_harness):
  """state -> the harness's metrics, as the eval's evaluate takes a state."""
  return lambda state: run_harness(state.model_params)


class _Windows:
  """The input of an objective that reads windows or pairs: the run's datasets' batches
  (loader.TrainBatches), less those earlier rollbacks took out. RolloutBatches is the other
  input (objectives that read rollouts); the loop takes either."""

  def __init__(self, start: Start, steps: step.ShardedSteps, position: DataPosition,
               rolled_back: set):
    run = start.run
    self._batches = loader.TrainBatches(
        start.sources, run.data, seq_len=run.model.seq_len, seed=run.trainer.seed,
        position=position, local_batch_size=run.trainer.batch_size // jax.process_count(),
        sharding=steps.batch_sharding, vocab_size=run.model.vocab_size, groups=start.reader_groups)
    self._rolled_back = rolled_back
    self._tokens_per_window = run.model.seq_len * self._batches.groups.count

  def next(self, step_num: int, state) -> tuple[dict, DataPosition, dict]:
    del step_num, state  # The stream alone decides.
    batch, position = next(self._batches)
    while position.windows in self._rolled_back:
      batch, position = next(self._batches)
    return batch, position, {}

  def ends_generation(self, step_num: int) -> bool:
    del step_num
    return True

  def metrics(self, position: DataPosition) -> dict[str, float]:
    """Tokens drawn from each source so far (all processes), and records lost to corruption."""
    metrics_ = {f"data/tokens/{name}": float(windows * self._tokens_per_window)
                for name, windows in position.per_source.items()}
    metrics_["data/tokens"] = float(position.windows * self._tokens_per_window)
    metrics_["data/corrupt_records_skipped"] = float(self._batches.corrupt_records_skipped)
    return metrics_

  def close(self) -> None:
    self._batches.close()


def _train_input(start: Start, steps: step.ShardedSteps, position: DataPosition,
                 rolled_back: set):
  """What the objective reads: sampled rollouts, or the datasets' windows."""
  if steps.objective.reads == "rollouts":
    return rollouts.RolloutBatches.for_run(start.run, steps, start.prompts, position)
  return _Windows(start, steps, position, rolled_back)


class _FlaggedSteps:
  """Counts steps whose update was skipped for a non-finite loss or gradient, and halts per
  policy; under spike_policy=rollback, its SpikeWatch counts the spikes and may roll back.

  The step computes each flag on the device; they are read together at the
  loop's boundaries (a log step, before a checkpoint or an eval, the last
  step), where the host waits for the device anyway, so no step waits for
  its predecessor. A halt therefore takes effect at the next boundary, and
  nothing computed after the non-finite step is saved. Under "skip", a run of
  more than `max_consecutive` skipped steps means divergence, and halts too.
  """

  def __init__(self, trainer: TrainerConfig, checkpointer: Checkpointer,
               restored: restore.Progress, rollbacks: spikes.Rollbacks):
    self._policy, self._max_consecutive = trainer.nan_policy, trainer.max_consecutive_skipped_steps
    self._checkpointer = checkpointer
    self._pending = []
    # As checkpointed: a run that crash-loops on bad data still reaches max_consecutive.
    self.count, self._consecutive = restored.skipped_steps, restored.consecutive_skipped_steps
    self._restored = restored
    self._spikes = (spikes.SpikeWatch(trainer.spike_window, trainer.spike_rollback_after,
                                      restored.recent_spikes, rollbacks.replayed_through())
                    if trainer.spike_policy == "rollback" else None)

  def progress(self, position: DataPosition) -> restore.Progress:
    """What a checkpoint saves with the state, once flushed."""
    return dataclasses.replace(self._restored, position=position, skipped_steps=self.count,
                               consecutive_skipped_steps=self._consecutive,
                               recent_spikes=self._spikes.recent if self._spikes else ())

  def add(self, step_num: int, position: DataPosition, step_metrics: dict) -> None:
    self._pending.append((step_num, step_metrics["train/nonfinite"]))
    if self._spikes:
      self._spikes.add(step_num, position.windows, step_metrics)

  def flush(self) -> None:
    """Reads the flags of every step since the last flush, in order; raises per policy (a
    spikes.RollBack too)."""
    steps, flags = zip(*self._pending) if self._pending else ((), ())
    self._pending = []
    for step_num, flag in zip(steps, jax.device_get(flags)):
      self._report(step_num, flag)
    if self._spikes:
      self._spikes.flush()

  def _report(self, step_num: int, flag) -> None:
    if not float(flag):
      self._consecutive = 0
      return
    self.count += 1
    self._consecutive += 1
    newest = self._checkpointer.latest_step
    if self._policy == "halt":
      raise UserError(f"non-finite loss or gradients at step {step_num}; stopped "
                      f"(config.trainer.nan_policy='halt'). The newest checkpoint is step "
                      f"{newest}; 'skip' would drop such updates and go on")
    if self._consecutive > self._max_consecutive:
      raise UserError(f"non-finite loss or gradients in {self._consecutive} steps in a row, up to "
                      f"step {step_num}: more than config.trainer.max_consecutive_skipped_steps "
                      f"({self._max_consecutive}); stopped. The newest checkpoint is step {newest}")
    logging.warning("Step %d: non-finite loss or gradients; its update was skipped", step_num)


def _train_loop(start: Start, workdir: epath.Path, steps: step.ShardedSteps,
                state: step.TrainState, progress: restore.Progress, checkpointer: Checkpointer,
                stop: preemption.StopSignal, compiled_step: "concurrent.futures.Future",
                lock: locks.JobLock, due_callbacks: callbacks_lib.Callbacks) -> TrainResult:
  run, sources, trainer = start.run, start.sources, start.run.trainer
  start_step = int(state.step)
  evaluate = _make_evaluate(run, steps, sources)
  run_harness = _make_harness(run, steps)
  throughput = metrics.Throughput(
      trainer.batch_size * run.model.seq_len, start_step,
      flops_per_token=steps.flops_per_token(run.model),
      num_devices=jax.device_count(),
      peak_flops=flops.peak_flops_per_device(jax.devices()[0], trainer.peak_flops_per_device))
  rollbacks = spikes.Rollbacks.read(workdir)
  nonfinite = _FlaggedSteps(trainer, checkpointer, progress, rollbacks)
  rolled_back = rollbacks.skipped_windows()  # Batches earlier rollbacks took out.
  spikes_skipped = spikes.skipped_spikes(state.opt_state)  # Restored with the state.
  spikes_skipped = None if spikes_skipped is None else int(spikes_skipped)
  position = progress.position
  watching = run.monitoring
  profile = watch.ProfileWindow(workdir, watching.profiler_start_step,
                                watching.profiler_num_steps if watching.profiler else 0)
  history, input_history, data_wait, steps_running, last_metrics = [], [], 0.0, 0, {}
  due_later = None  # A save due within a generation of rollouts, made at its end.
  # Closed also when a step raises: TF complains about pipelines left for interpreter exit.
  with contextlib.closing(_train_input(start, steps, position, rolled_back)) as train_input, \
      _metric_writer(run, workdir, lock) as writer, \
      watch.HangWatchdog(watching.hang_watchdog_seconds) as watchdog:
    writer.write_scalars(start_step, {RUN_START: start_step})
    if resume_checks.eval_missed(start.run, start.sources, workdir, checkpointer, start_step):
      last_metrics = _evaluate_missed_step("eval", evaluate, state, writer)
    if run_harness and resume_checks.harness_missed(start.run, workdir, checkpointer, start_step):
      last_metrics |= _evaluate_missed_step("harness", _harness_of_state(run_harness), state,
                                            writer)
    report_progress = periodic_actions.ReportProgress(
        num_train_steps=trainer.num_train_steps, writer=writer, every_steps=trainer.log_every_steps)
    for step_num in range(start_step + 1, trainer.num_train_steps + 1):
      profile.before_step(step_num)
      with jax.profiler.StepTraceAnnotation("train", step_num=step_num):
        wait_start = time.perf_counter()
        with jax.profiler.TraceAnnotation("data_wait"):
          batch, position, input_metrics = train_input.next(step_num, state)
        data_wait += time.perf_counter() - wait_start
        if step_num == start_step + 1:
          # The compiler refused it, or a buffer failed to allocate as it started.
          with batch_search.out_of_memory_named(trainer):
            train_step = compiled_step.result()
            state, step_metrics = train_step(state, batch)
        else:
          state, step_metrics = train_step(state, batch)
      steps_running += _steps_running(history)
      history.append(step_metrics)
      if input_metrics:
        input_history.append(input_metrics)
      if len(history) > _MAX_STEPS_AHEAD:  # Waits only when the device is that far behind.
        history[-_MAX_STEPS_AHEAD - 1]["train/loss"].block_until_ready()
      nonfinite.add(step_num, position, step_metrics)
      if step_num == start_step + 1:
        # Leave compilation out of the throughput figures.
        with batch_search.out_of_memory_named(trainer):  # It failed to allocate as it ran.
          jax.block_until_ready(step_metrics)
        throughput.reset(step_num)
      finished = step_num == trainer.num_train_steps
      # Preempted: log and checkpoint now, skip eval.
      stopping = stop.requested(step_num) and train_input.ends_generation(step_num)
      log_step = step_num % trainer.log_every_steps == 0
      if log_step or finished or stopping:
        nonfinite.flush()
        means = _mean(history)
        del means["train/nonfinite"]  # Reported as the running count of skipped steps.
        means.pop("train/spike", None)  # Likewise: train/spike_skipped_steps.
        last_metrics = (means | throughput.measure(step_num)
                        | {"train/data_wait_seconds": data_wait / len(history),
                           "train/steps_in_flight": steps_running / len(history),
                           "train/skipped_steps": float(nonfinite.count)}
                        | train_input.metrics(position)
                        | (_mean(input_history) if input_history else {})
                        | watch.memory_metrics())
        writer.write_scalars(step_num, last_metrics)
        if spikes_skipped is not None and last_metrics["train/spike_skipped_steps"] > spikes_skipped:
          logging.warning("Steps %d-%d: %d loss spike(s) skipped, their updates dropped (%d in all)",
                          step_num - len(history) + 1, step_num,
                          last_metrics["train/spike_skipped_steps"] - spikes_skipped,
                          last_metrics["train/spike_skipped_steps"])
          spikes_skipped = int(last_metrics["train/spike_skipped_steps"])
        history, input_history, data_wait, steps_running = [], [], 0.0, 0
      report_progress(step_num)
      # The clock is asked on log steps only, where the host waits for the device anyway.
      due = checkpointer.due(step_num, forced=finished or stopping, ask_clock=log_step) or due_later
      due_later = None
      if due and not train_input.ends_generation(step_num):  # Saved where a resume can sample.
        due, due_later = None, due
      if due:  # Before eval: a failing eval must not cost the step's checkpoint.
        nonfinite.flush()  # A halt due saves nothing from after the non-finite step.
        with _phase(report_progress, "checkpoint"):
          checkpointer.save(step_num, state.checkpointed, nonfinite.progress(position).to_json(),
                          due)
      eval_metrics = {}
      if step_num % trainer.eval_every_steps == 0 or finished:
        nonfinite.flush()
        with _phase(report_progress, "eval"):
          eval_metrics = evaluate(state)
        writer.write_scalars(step_num, eval_metrics)
        last_metrics |= eval_metrics
        throughput.reset(step_num)
      if run_harness and (step_num % trainer.eval_harness_every_steps == 0 or finished):
        nonfinite.flush()
        with _phase(report_progress, "harness"):
          harness_metrics = run_harness(state.model_params)
        writer.write_scalars(step_num, harness_metrics)
        last_metrics |= harness_metrics
        eval_metrics = eval_metrics | harness_metrics  # What a callback sees of the step.
        throughput.reset(step_num)
      due_callbacks.after_step(step_num, state, step_metrics, eval_metrics)
      profile.after_step(step_num, state)  # The window's last eval and checkpoint are in it.
      watchdog.step_finished(step_num)
      if stopping:
        logging.warning("Stopped at step %d on request; its checkpoint is written before exit",
                        step_num)
        break
    profile.close(step_num, state)
  return TrainResult(state, last_metrics)


@contextlib.contextmanager
def _phase(report_progress: periodic_actions.ReportProgress, name: str):
  """A named part of the loop: a span in the profile, and its share of time in the progress log."""
  with jax.profiler.TraceAnnotation(name), report_progress.timed(name):
    yield
