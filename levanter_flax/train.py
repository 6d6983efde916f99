"""The training loop: build or restore the state, run steps, log, eval, checkpoint."""
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import time
from typing import Optional

import jax
import numpy as np
from absl import logging
from clu import periodic_actions
from etils import epath
from jax.experimental import multihost_utils

from levanter_flax import (batch_search, config, distributed, flops, hf, locks, metrics, models,
                           monitoring, partitioning, paths, preemption, report, step)
from levanter_flax.checkpoint import Checkpointer, abstract_like, load_other_run
from levanter_flax.settings import RunConfig
from levanter_flax.data import eval_set, loader
from levanter_flax.data.manifest import PreparedDataset
from levanter_flax.data.position import DataPosition, ReaderGroups, default_reader_groups
from levanter_flax.errors import UserError
from levanter_flax.models import common


def _check_batch_size(trainer, partitioner: partitioning.Partitioner) -> None:
  microbatch = trainer.batch_size // trainer.gradient_accumulation_steps
  for divisor, what in ((partitioner.data_parallel_size, "the activation axis size"),
                        (jax.process_count(), "the process count")):
    if microbatch % divisor:
      raise UserError(f"config.trainer.batch_size ({trainer.batch_size}) / "
                      f"gradient_accumulation_steps ({trainer.gradient_accumulation_steps}) "
                      f"must be divisible by {what} ({divisor})")


def _check_backend(model) -> None:
  backend = jax.default_backend()
  if common.attention_implementation(model) == "cudnn" and backend != "gpu":
    raise UserError(f"config.model.compute.attention_impl 'cudnn' needs an NVIDIA GPU; "
                    f"this run's backend is {backend}")
  if model.compute.remat == "offload" and backend == "cpu":
    raise UserError("config.model.compute.remat 'offload' moves activations to host memory, "
                    "which needs a GPU or TPU; this run's backend is cpu")


def _use_compilation_cache(trainer) -> None:
  """Compiled steps persist across runs; jax itself reads $JAX_COMPILATION_CACHE_DIR."""
  if trainer.jax_compilation_cache_dir:
    what = "config.trainer.jax_compilation_cache_dir"
    directory = paths.make_dirs(paths.resolve(trainer.jax_compilation_cache_dir, what), what)
    jax.config.update("jax_compilation_cache_dir", str(directory))
  jax.config.update("jax_persistent_cache_min_compile_time_secs",
                    trainer.jax_persistent_cache_min_compile_time_secs)


def _saved_config(workdir: epath.Path, checkpointer: Checkpointer,
                  resume_without_config: bool) -> Optional[dict]:
  """The config.json the workdir's checkpoints were written with; None if it has none.

  Checkpoints without one are refused, unless `resume_without_config`: nothing
  could check that this config fits them.
  """
  if checkpointer.latest_step is None:
    return None
  path = workdir / "config.json"
  try:
    saved = config.read_saved(workdir)
  except (OSError, ValueError) as e:
    raise UserError(f"cannot read {path}, the config the checkpoints were written with: {e}; "
                    f"restore it, or use a new --workdir") from None
  if saved is None and not resume_without_config:
    raise UserError(f"{checkpointer.directory} holds checkpoints (the newest at step "
                    f"{checkpointer.latest_step}) but {path}, the config they were written with, "
                    f"is missing: nothing can check that this config fits them; restore it, or "
                    f"set config.checkpoint.resume_without_config=True to resume them unchecked")
  if saved is None:
    logging.warning("Resuming the checkpoints in %s without the config they were written with "
                    "(config.checkpoint.resume_without_config)", checkpointer.directory)
  return saved


def _check_resumed_config(run: RunConfig, saved: Optional[dict], workdir: epath.Path) -> list[str]:
  """Refuses to resume into another model or optimizer state; returns the other changes.

  Checked before anything is restored, so a changed optimizer is never taken
  for a damaged checkpoint.
  """
  if saved is None:
    return []
  now = config.flat_dict(run)
  refused = config.state_changes(saved, now)
  if refused:
    raise UserError(f"cannot resume the checkpoints in {workdir} with a different model or "
                    f"optimizer: {', '.join(refused)}; use a new --workdir")
  for old, (new, _) in config.REPLACED_KEYS.items():
    if old in saved:
      logging.warning("The run in %s started with %s, which %s replaced: its evals before this "
                      "resume scored another set", workdir, old, new)
  changed = config.changes(saved, now)
  for change in changed:
    if not change.startswith("trainer.distributed "):  # Another address or id is no news.
      logging.warning("Resuming with %s", change)
  return changed


def _fix_reader_groups(run: RunConfig, saved: Optional[dict], sources: list[PreparedDataset],
                       workdir: epath.Path) -> RunConfig:
  """`run` with data.reader_groups as the run first started with it: the batches depend on it.

  A new run takes config.data.reader_groups, or the default for its batch
  size and datasets; config.json then keeps it for every resume.
  """
  asked, started = run.data.reader_groups, (saved or {}).get("data.reader_groups", 0)
  if asked and started and asked != started:
    raise UserError(f"config.data.reader_groups is {asked}, but the run in {workdir} started "
                    f"with {started}: its batches would change; leave the key unset to resume, "
                    f"or use a new --workdir")
  if saved is not None and not started and not asked:  # An older version: one per process.
    started = jax.process_count()
    logging.warning("The run in %s saved no reader-group count (an older version read one per "
                    "process); resuming with %d, the same stream only if it ran on %d processes",
                    workdir, started, started)
  count = started or asked or default_reader_groups(run.trainer.batch_size, jax.process_count(),
                                                    sources, run.model.seq_len)
  run = dataclasses.replace(run, data=dataclasses.replace(run.data, reader_groups=count))
  # This process count and batch size must fit it: say so before anything is restored.
  _reader_groups(run).rows_per_group(run.trainer.batch_size // jax.process_count(),
                                     "config.trainer.batch_size")
  return run


def _save_config(run: RunConfig, workdir: epath.Path) -> None:
  """<workdir>/config.json: what the checkpoints were written with, for the next resume."""
  if jax.process_index() > 0:  # The workdir is shared; one writer.
    return
  path = workdir / "config.json"
  try:
    paths.write_atomically(path, json.dumps(config.flat_dict(run), indent=2))
  except OSError as e:
    raise UserError(f"cannot write {path}: {e.strerror or e}") from None


def _check_vocab(source: PreparedDataset, vocab_size: int) -> None:
  needed = source.manifest["tokenizer"]["vocab_size"]
  if vocab_size < needed:
    raise UserError(f"config.model.vocab_size ({vocab_size}) is smaller than the vocabulary of "
                    f"the tokenizer ({needed}) that {source.directory} was prepared with")


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


def _mean(history: list[dict]) -> dict[str, float]:
  history = jax.device_get(history)  # Never empty: callers check.
  return {k: float(np.mean([m[k] for m in history])) for k in history[0]}


def train_and_evaluate(run: RunConfig, workdir: epath.Path) -> dict[str, float]:
  """Trains to run.trainer.num_train_steps, resuming from workdir; returns the last metrics.

  The workdir is locked first: a second run in it is refused rather than
  merged with this one.
  """
  workdir = paths.make_dirs(workdir, "workdir")
  with locks.locked_for_job(workdir, "workdir") as lock:
    return _build_and_train(run, workdir, lock)


def _build_and_train(run: RunConfig, workdir: epath.Path, lock: locks.JobLock) -> dict[str, float]:
  trainer = run.trainer
  _check_backend(run.model)
  _use_compilation_cache(trainer)
  mesh = partitioning.make_mesh(trainer.device_mesh)
  partitioner = partitioning.Partitioner(mesh, run.sharding)
  if trainer.batch_size == "auto":
    trainer = batch_search.resolve(run, partitioner)
    run = dataclasses.replace(run, trainer=trainer)
    logging.info("batch_size 'auto': %d sequences per step in %d microbatches",
                 trainer.batch_size, trainer.gradient_accumulation_steps)
  _check_batch_size(trainer, partitioner)
  sources = loader.load_datasets(run.data)
  _check_vocab(sources[0], run.model.vocab_size)
  for source in sources:  # A split too small to evaluate: said now, not after the first steps.
    if source.has_validation:
      eval_set.num_windows(source, run.model.seq_len, trainer.eval_tokens)

  eos_id = sources[0].manifest["tokenizer"]["eos_id"] if run.data.document_masking else None
  steps = step.build(run, partitioner, eos_id)
  num_params = sum(x.size for x in jax.tree.leaves(steps.abstract_state.params))
  logging.info("Model: %s, %s parameters; mesh %s", run.model, f"{num_params:,}", dict(mesh.shape))
  logging.info("Parameter layout:\n%s", steps.layout_table())

  # The signal handlers stay until the last save is written: a second SIGTERM then waits too.
  with partitioner.activation_context(), preemption.StopSignal() as stop, \
      contextlib.closing(Checkpointer(workdir / "checkpoints", run.checkpoint,
                                      before_save=lock.check_all)) as checkpointer:
    saved = _saved_config(workdir, checkpointer, run.checkpoint.resume_without_config)
    run = _fix_reader_groups(run, saved, sources, workdir)
    config_changes = _check_resumed_config(run, saved, workdir)
    # Compiled while the state is restored or created and the input starts; not for a run
    # that looks finished, which only says so.
    compile_step = functools.partial(step.compile_in_background, steps, partitioner,
                                     trainer.batch_size)
    finished = (checkpointer.latest_step or 0) >= trainer.num_train_steps
    compiled_step = None if finished else compile_step()
    try:
      state, progress = _initial_state(run, workdir, steps, checkpointer, sources,
                                       config_changes)
      if int(state.step) >= trainer.num_train_steps:
        if _eval_missed(run, workdir, sources, checkpointer, int(state.step)):
          with contextlib.closing(metrics.create_writer(workdir, lock.may_write)) as writer:
            _evaluate_missed_step(_make_evaluate(run, steps, sources), state, writer)
        logging.warning("Already finished: the newest checkpoint is step %d, and "
                        "config.trainer.num_train_steps is %d; raise it to train on",
                        int(state.step), trainer.num_train_steps)
        return {}
      _save_config(run, workdir)
      compiled_step = compiled_step or compile_step()  # The newest checkpoint was unusable.
      return _train_loop(run, workdir, steps, state, progress, checkpointer, sources, stop,
                         compiled_step, lock)
    finally:
      # It cannot be cancelled: a run that stops early waits for it, so that nothing prints
      # after the run's last line and no compiler thread outlives the interpreter.
      if compiled_step:
        concurrent.futures.wait([compiled_step])


@dataclasses.dataclass(frozen=True)
class Progress:
  """The checkpoint's `data` item: where the input stream is, and the skipped-step counts
  (trainer.nan_policy='skip'), which a restart must not reset."""
  position: DataPosition
  skipped_steps: int = 0
  consecutive_skipped_steps: int = 0

  def to_json(self) -> dict:
    return self.position.to_json() | {"skipped_steps": self.skipped_steps,
                                      "consecutive_skipped_steps": self.consecutive_skipped_steps}

  @classmethod
  def from_json(cls, value: dict) -> "Progress":
    """Raises ValueError for anything but what to_json writes (the counts: 0 if absent)."""
    position = DataPosition.from_json(value)
    counts = [value.get(key, 0) for key in ("skipped_steps", "consecutive_skipped_steps")]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts):
      raise ValueError(f"not a count of skipped steps: {counts}")
    return cls(position, *counts)


def _initial_state(run: RunConfig, workdir: epath.Path, steps: step.ShardedSteps,
                   checkpointer: Checkpointer, sources: list[PreparedDataset],
                   config_changes: list[str]) -> tuple[step.TrainState, Progress]:
  """This run's newest usable checkpoint; else a Hugging Face checkpoint's params
  (init_from_hf) or another run's (load_checkpoint_path); else init."""
  state, progress = _restored_or_initial_state(run, workdir, steps, checkpointer, sources,
                                               config_changes)
  position, reader_groups = progress.position, run.data.reader_groups
  if position.reader_groups not in (None, reader_groups):
    raise UserError(f"the data position of the checkpoint to resume from was read by "
                    f"{position.reader_groups} reader groups, but this run has {reader_groups} "
                    f"(config.data.reader_groups): set it to {position.reader_groups}")
  position = distributed.agreed(
      lambda: position.in_datasets_of(sources, run.data.restart_changed_datasets),
      "to resume on its datasets")
  return state, dataclasses.replace(progress, position=position)


def _restored_or_initial_state(run: RunConfig, workdir: epath.Path, steps: step.ShardedSteps,
                               checkpointer: Checkpointer, sources: list[PreparedDataset],
                               config_changes: list[str]) -> tuple[step.TrainState, Progress]:
  trainer = run.trainer
  abstract = abstract_like(steps.abstract_state, steps.state_shardings)
  restored = checkpointer.restore_newest_usable(abstract, Progress.from_json,
                                                run.checkpoint.start_fresh_if_unusable, config_changes)
  if restored:
    state, progress = restored
    logging.info("Resuming from checkpoint at step %d; %s", int(state.step), progress)
    return state, progress
  _warn_if_logged_before(workdir, checkpointer)
  fresh = (steps.init(jax.random.key(trainer.seed)),
           Progress(DataPosition.start(sources, run.data.reader_groups)))
  if trainer.init_from_hf:
    logging.info("Starting from the Hugging Face checkpoint %s", trainer.init_from_hf)
    return fresh[0].replace(params=_params_from_hf(trainer.init_from_hf, run.model, steps)), fresh[1]
  load = run.checkpoint
  if not load.load_path:
    return fresh
  state, data = load_other_run(paths.resolve(load.load_path, "config.checkpoint.load_path"),
                               abstract)
  logging.info("Starting from %s of %s", load.load_items, load.load_path)
  if load.load_items == "state":
    try:
      return state, Progress.from_json(data)
    except ValueError as e:
      raise UserError(f"config.checkpoint.load_path {load.load_path}: its data item is malformed "
                      f"({e}); load only its params (config.checkpoint.load_items='params')") from None
  return fresh[0].replace(params=state.params), fresh[1]


def _logged_history(workdir: epath.Path) -> Optional[report.Run]:
  """The workdir's metrics.jsonl as read by `report`, or None if it has none it can read."""
  path = workdir / "metrics.jsonl"
  if not path.is_file() or not path.read_bytes():  # Opened by a run killed before its first log.
    return None
  try:
    return report.load_run(workdir, workdir.name)
  except UserError as e:
    logging.warning("%s", e)
    return None


def _warn_if_logged_before(workdir: epath.Path, checkpointer: Checkpointer) -> None:
  """A run starting from step 0 where an earlier one logged steps: its checkpoints are gone."""
  if jax.process_index() > 0:  # One reader, one warning.
    return
  history = _logged_history(workdir)
  logged = max((step_num for series in history.series.values() for step_num in series),
               default=0) if history else 0
  if logged:
    logging.warning("Starting from step 0, but %s logged steps up to %d: no usable checkpoint "
                    "of that run is in %s (deleted, set aside as damaged, or none was written "
                    "before it stopped)",
                    workdir / "metrics.jsonl", logged, checkpointer.directory)


def _eval_missed(run: RunConfig, workdir: epath.Path, sources: list[PreparedDataset],
                 checkpointer: Checkpointer, step_num: int) -> bool:
  """Whether `step_num`, restored from this run's own checkpoint, is an eval step that
  metrics.jsonl has no eval for: the run was killed between its checkpoint and its eval.
  Process 0 reads the file and tells the others."""
  trainer = run.trainer
  if (not step_num or checkpointer.latest_step != step_num
      or not any(s.has_validation for s in sources)
      or (step_num % trainer.eval_every_steps and step_num != trainer.num_train_steps)):
    return False
  missed = False
  if jax.process_index() == 0:
    history = _logged_history(workdir)
    missed = step_num not in (history.series.get("eval/loss", {}) if history else {})
  return bool(multihost_utils.broadcast_one_to_all(np.array(missed)))


def _evaluate_missed_step(evaluate, state: step.TrainState, writer) -> dict[str, float]:
  step_num = int(state.step)
  logging.warning("Step %d's eval was not logged (the run stopped between its checkpoint and its "
                  "eval); evaluating it now", step_num)
  eval_metrics = evaluate(state.params)
  writer.write_scalars(step_num, eval_metrics)
  return eval_metrics


def _params_from_hf(path: str, model_cfg, steps: step.ShardedSteps):
  """An HF checkpoint's weights, checked against this model and laid out on the mesh."""
  hf_cfg, params = hf.load(paths.resolve(path, "config.trainer.init_from_hf"),
                           model_cfg.compute.scan_layers)
  differences = hf.differences(hf_cfg, model_cfg)
  expected = steps.abstract_state.params
  if not differences and jax.tree.structure(params) == jax.tree.structure(expected):
    differences = [f"{partitioning.path_name(p)} {x.shape} (checkpoint) != {e.shape} (config)"
                   for (p, x), e in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                                        jax.tree.leaves(expected)) if x.shape != e.shape]
  if differences:
    raise UserError(f"config.trainer.init_from_hf {path} does not fit this model: "
                    f"{'; '.join(differences)}")
  return jax.device_put(jax.tree.map(lambda x, e: x.astype(e.dtype), params, expected),
                        steps.state_shardings.params)


def _make_evaluate(run: RunConfig, steps: step.ShardedSteps, sources: list[PreparedDataset]):
  """params -> eval/loss, its standard error, perplexity, bits per byte and the tokens scored,
  per source for a mixture. Each source's eval set is read now, before training."""
  evaluated = [s for s in sources if s.has_validation]
  if not evaluated:
    logging.warning("No dataset has a validation split: no eval metrics")
  # Each process reads its own share: damage found in one is every process's error.
  eval_sets = distributed.agreed(lambda: [
      eval_set.build(source, seq_len=run.model.seq_len, eval_tokens=run.trainer.eval_tokens,
                     vocab_size=run.model.vocab_size, process_index=jax.process_index(),
                     process_count=jax.process_count()) for source in evaluated],
                                 "to read its share of the eval set")
  # Microbatch-sized: what fits in memory for training fits for eval.
  batch_size = run.trainer.batch_size // run.trainer.gradient_accumulation_steps

  def evaluate(params) -> dict[str, float]:
    results = {}
    for windows in eval_sets:
      loss, stderr = eval_set.evaluate(windows, steps.eval_step, params, batch_size,
                                       steps.batch_sharding)
      prefix = "eval" if len(sources) == 1 else f"eval/{windows.source.name}"
      bits_per_byte = loss / np.log(2) * windows.source.validation_tokens_per_byte
      results |= {f"{prefix}/loss": loss, f"{prefix}/loss_stderr": stderr,
                  f"{prefix}/perplexity": float(np.exp(loss)),
                  f"{prefix}/bits_per_byte": float(bits_per_byte),
                  f"{prefix}/tokens": float(windows.scored_tokens)}
    if len(sources) > 1 and evaluated:
      weights = [s.weight for s in evaluated]
      results["eval/loss"] = float(np.average([results[f"eval/{s.name}/loss"] for s in evaluated],
                                              weights=weights))
    return results
  return evaluate


def _reader_groups(run: RunConfig) -> ReaderGroups:
  """This process's reader groups."""
  return ReaderGroups.of_process(run.data.reader_groups, jax.process_index(), jax.process_count())


def _data_metrics(position: DataPosition, batches: loader.TrainBatches,
                  tokens_per_window: int) -> dict[str, float]:
  """Tokens drawn from each source so far (all processes), and records lost to corruption."""
  metrics_ = {f"data/tokens/{name}": float(windows * tokens_per_window)
              for name, windows in position.per_source.items()}
  metrics_["data/tokens"] = float(position.windows * tokens_per_window)
  metrics_["data/corrupt_records_skipped"] = float(batches.corrupt_records_skipped)
  return metrics_


class _NonFiniteSteps:
  """Counts steps whose update was skipped for a non-finite loss or gradient; halts per policy.

  The step computes each flag on the device; they are read together at the
  loop's boundaries (a log step, before a checkpoint or an eval, the last
  step), where the host waits for the device anyway, so no step waits for
  its predecessor. A halt therefore takes effect at the next boundary, and
  nothing computed after the non-finite step is saved. Under "skip", a run of
  more than `max_consecutive` skipped steps means divergence, and halts too.
  """

  def __init__(self, policy: str, max_consecutive: int, checkpointer: Checkpointer,
               restored: Progress):
    self._policy, self._max_consecutive, self._checkpointer = policy, max_consecutive, checkpointer
    self._pending = []
    # As checkpointed: a run that crash-loops on bad data still reaches max_consecutive.
    self.count, self._consecutive = restored.skipped_steps, restored.consecutive_skipped_steps

  def progress(self, position: DataPosition) -> Progress:
    """What a checkpoint saves with the state, once flushed."""
    return Progress(position, self.count, self._consecutive)

  def add(self, step_num: int, step_metrics: dict) -> None:
    self._pending.append((step_num, step_metrics["train/nonfinite"]))

  def flush(self) -> None:
    """Reads the flags of every step since the last flush, in order; raises per policy."""
    steps, flags = zip(*self._pending) if self._pending else ((), ())
    self._pending = []
    for step_num, flag in zip(steps, jax.device_get(flags)):
      self._report(step_num, flag)

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


def _train_loop(run: RunConfig, workdir: epath.Path, steps: step.ShardedSteps,
                state: step.TrainState, progress: Progress,
                checkpointer: Checkpointer, sources: list[PreparedDataset],
                stop: preemption.StopSignal,
                compiled_step: "concurrent.futures.Future",
                lock: locks.JobLock) -> dict[str, float]:
  trainer = run.trainer
  start_step = int(state.step)
  evaluate = _make_evaluate(run, steps, sources)
  throughput = metrics.Throughput(
      trainer.batch_size * run.model.seq_len, start_step,
      flops_per_token=models.flops_per_token(run.model, steps.abstract_state.params),
      num_devices=jax.device_count(),
      peak_flops=flops.peak_flops_per_device(jax.devices()[0], trainer.peak_flops_per_device))
  nonfinite = _NonFiniteSteps(trainer.nan_policy, trainer.max_consecutive_skipped_steps,
                              checkpointer, progress)
  position = progress.position
  watching = run.monitoring
  profile = monitoring.ProfileWindow(workdir, watching.profiler_start_step,
                                     watching.profiler_num_steps if watching.profiler else 0)
  history, data_wait, steps_running, last_metrics = [], 0.0, 0, {}
  # Closed also when a step raises: TF complains about pipelines left for interpreter exit.
  with contextlib.closing(loader.TrainBatches(
      sources, run.data, seq_len=run.model.seq_len, seed=trainer.seed, position=position,
      local_batch_size=trainer.batch_size // jax.process_count(), sharding=steps.batch_sharding,
      vocab_size=run.model.vocab_size, groups=_reader_groups(run))) as train_batches, \
      contextlib.closing(metrics.create_writer(workdir, lock.may_write)) as writer, \
      monitoring.HangWatchdog(watching.hang_watchdog_seconds) as watchdog:
    writer.write_scalars(start_step, {report.RUN_START: start_step})
    if _eval_missed(run, workdir, sources, checkpointer, start_step):
      last_metrics = _evaluate_missed_step(evaluate, state, writer)
    report_progress = periodic_actions.ReportProgress(
        num_train_steps=trainer.num_train_steps, writer=writer, every_steps=trainer.log_every_steps)
    for step_num in range(start_step + 1, trainer.num_train_steps + 1):
      profile.before_step(step_num)
      with jax.profiler.StepTraceAnnotation("train", step_num=step_num):
        wait_start = time.perf_counter()
        with jax.profiler.TraceAnnotation("data_wait"):
          batch, position = next(train_batches)
        data_wait += time.perf_counter() - wait_start
        if step_num == start_step + 1:
          train_step = compiled_step.result()
        state, step_metrics = train_step(state, batch)
      steps_running += _steps_running(history)
      history.append(step_metrics)
      if len(history) > _MAX_STEPS_AHEAD:  # Waits only when the device is that far behind.
        history[-_MAX_STEPS_AHEAD - 1]["train/loss"].block_until_ready()
      nonfinite.add(step_num, step_metrics)
      if step_num == start_step + 1:
        # Leave compilation out of the throughput figures.
        jax.block_until_ready(step_metrics)
        throughput.reset(step_num)
      finished = step_num == trainer.num_train_steps
      stopping = stop.requested(step_num)  # Preempted: log and checkpoint now, skip eval.
      log_step = step_num % trainer.log_every_steps == 0
      if log_step or finished or stopping:
        nonfinite.flush()
        means = _mean(history)
        del means["train/nonfinite"]  # Reported as the running count of skipped steps.
        last_metrics = (means | throughput.measure(step_num)
                        | {"train/data_wait_seconds": data_wait / len(history),
                           "train/steps_in_flight": steps_running / len(history),
                           "train/skipped_steps": float(nonfinite.count)}
                        | _data_metrics(position, train_batches,
                                        run.model.seq_len * train_batches.groups.count)
                        | monitoring.memory_metrics())
        writer.write_scalars(step_num, last_metrics)
        history, data_wait, steps_running = [], 0.0, 0
      report_progress(step_num)
      # The clock is asked on log steps only, where the host waits for the device anyway.
      due = checkpointer.due(step_num, forced=finished or stopping, ask_clock=log_step)
      if due:  # Before eval: a failing eval must not cost the step's checkpoint.
        nonfinite.flush()  # A halt due saves nothing from after the non-finite step.
        with _phase(report_progress, "checkpoint"):
          checkpointer.save(step_num, state, nonfinite.progress(position).to_json(), due)
      if step_num % trainer.eval_every_steps == 0 or finished:
        nonfinite.flush()
        with _phase(report_progress, "eval"):
          eval_metrics = evaluate(state.params)
        writer.write_scalars(step_num, eval_metrics)
        last_metrics |= eval_metrics
        throughput.reset(step_num)
      profile.after_step(step_num, state)  # The window's last eval and checkpoint are in it.
      watchdog.step_finished(step_num)
      if stopping:
        logging.warning("Stopped at step %d on request; its checkpoint is written before exit",
                        step_num)
        break
    profile.close(step_num, state)
  return last_metrics


@contextlib.contextmanager
def _phase(report_progress: periodic_actions.ReportProgress, name: str):
  """A named part of the loop: a span in the profile, and its share of time in the progress log."""
  with jax.profiler.TraceAnnotation(name), report_progress.timed(name):
    yield
