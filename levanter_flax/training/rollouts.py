"""GRPO's rollouts: each prompt's group of completions, sampled by the generation engine from
the current params, scored by the rewards and turned into a training batch.

A batch row is a prompt and one of its completions, with the stop token that ended it (so the
policy learns to stop), zero-padded to seq_len; its loss weights are 1 on the completion's
tokens (as targets) and 0 elsewhere; its advantage is objectives/grpo.group_advantages' of
the group's rewards. Completion j of the prompt at run position p samples with the seed drawn
from (seed, p, j): a run resumed at p samples what it would have sampled.

A completion ends at the first of its prompt's stop ids: the tokenizer's EOS ids, and for a
chat record its template's end of turn (generate/prompts.reply_stop_ids, as the server's chat
endpoint stops).

`RolloutBatches` makes a run's training batches of them: generation g (steps g k + 1 to
(g + 1) k, k = rl.updates_per_batch) samples the P = trainer.batch_size / rl.group_size prompts
that follow those the generations before it trained on, from the params before its first step.
The run position of those prompts continues from the checkpoint's, whatever group_size or
batch_size a resume changes; the prompts' order is a permutation per pass over the file, drawn
from the run's seed.

On several processes, each samples and scores only the rows its devices hold, on an engine of
its own devices (Sampler.per_process): the work divides by the processes. The params reach it
replicated, once a generation; the rewards, lengths and stops of every row are gathered once
a generation, so that the processes' advantages agree whatever a reward does.
"""
import contextlib
import dataclasses
import functools
import time
from typing import Any, Callable, ContextManager, Sequence

from absl import logging
import jax
import numpy as np

from levanter_flax import models
from levanter_flax.core.errors import UserError
from levanter_flax.data import chat, rl_prompts, tokenizers
from levanter_flax.data.position import DataPosition
from levanter_flax.data.rl_prompts import PromptRecord
from levanter_flax.generate import prompts as prompt_tokens
from levanter_flax.generate.engine import Engine, Request, SamplingParams
from levanter_flax.objectives import grpo, rewards as rewards_lib
from levanter_flax.parallel import distributed, partitioning

Batch = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class Rollouts:
  # int32 [prompts x group, seq_len]: prompt, completion, stop token, zeros; another
  # process's rows are zeros.
  tokens: np.ndarray
  loss_weights: np.ndarray  # float32, tokens' shape: 1 on each completion token (a target).
  advantages: np.ndarray  # float32 [prompts x group].
  rewards: np.ndarray  # float32 [prompts x group]: the weighted sums.
  metrics: dict[str, float]


def completion_seed(seed: int, position: int, index: int) -> int:
  """The sampling seed of completion `index` of the prompt at run position `position`."""
  return int(np.random.SeedSequence([seed, position, index]).generate_state(1)[0])


def sample(engine: Engine, records: Sequence[PromptRecord], prompts: Sequence[Sequence[int]],
           stop_ids: Sequence[tuple[int, ...]], positions: Sequence[int], group_size: int,
           sampling: SamplingParams, seed: int, rewards: Sequence[rewards_lib.Reward],
           scale_rewards: str, seq_len: int,
           local_rows: Sequence[int] | None = None) -> Rollouts:
  """The rollouts of `prompts` (their tokens; `records` their text and fields; `stop_ids` the
  ids each one's completions end at; `positions` their places in the run's order of prompts),
  group_size completions each.

  local_rows: the rows (completions) this process samples and scores, the others' rewards,
  lengths and stops gathered from the processes that hold them, so that every process
  computes the advantages from the same rewards, however a reward varies between calls;
  None: every row (one process)."""
  for record, prompt in zip(records, prompts, strict=True):
    _check_room(record, prompt, sampling.max_tokens, engine.max_len)
  count = len(prompts) * group_size
  rows = range(count) if local_rows is None else local_rows
  record_of = lambda row: records[row // group_size]
  samplings = [dataclasses.replace(sampling, stop_ids=stop_ids[row // group_size],
                                   seed=completion_seed(seed, positions[row // group_size],
                                                        row % group_size)) for row in rows]
  started = time.perf_counter()
  requests = engine.generate([list(prompts[row // group_size]) for row in rows], samplings)
  seconds = time.perf_counter() - started
  completions = []

  def per_row() -> dict[str, np.ndarray]:
    # Here, so that a completion that failed on one process stops every process.
    completions.extend(_completion(r, record_of(row)) for row, r in zip(rows, requests))
    total, each = rewards_lib.score(
        rewards, [r.text for r in requests], [record_of(row).text for row in rows],
        {name: [record_of(row).fields[name] for row in rows] for name in _common_fields(records)})
    return {"reward": total, **{f"reward/{name}": values for name, values in each.items()},
            "length": np.array([len(c) for c in completions], np.float32),
            "stopped": np.array([r.stop_id is not None for r in requests], np.float32)}
  if local_rows is None:
    values = per_row()
  else:  # A reward or completion that fails on one process stops every process.
    values = _gathered(local_rows, distributed.agreed(per_row, "to score its rollouts"), count)
  total = values["reward"]
  advantages = grpo.group_advantages(total, group_size, scale_rewards)
  tokens = np.zeros((count, seq_len), np.int32)
  weights = np.zeros((count, seq_len), np.float32)
  for row, request, completion in zip(rows, requests, completions):
    start = len(request.prompt)
    tokens[row, :start] = request.prompt
    tokens[row, start:start + len(completion)] = completion
    weights[row, start:start + len(completion)] = 1
  grouped = total.reshape(-1, group_size)
  metrics = {"rl/reward_mean": float(total.mean()), "rl/reward_std": float(total.std()),
             **{f"rl/{name}": float(v.mean()) for name, v in values.items()
                if name.startswith("reward/")},
             "rl/advantage_abs_mean": float(np.abs(advantages).mean()),
             "rl/groups_all_equal": float((grouped.max(axis=1) == grouped.min(axis=1)).mean()),
             "rl/completion_length": float(values["length"].mean()),
             "rl/stopped_fraction": float(values["stopped"].mean()),
             "rl/generation_seconds": seconds,
             # The processes sample at once: every row's tokens in this one's time.
             "rl/generation_tokens_per_second": float(values["length"].sum() / max(seconds, 1e-9))}
  return Rollouts(tokens, weights, advantages, total, metrics)


def stop_ids(records: Sequence[PromptRecord], template: chat.ChatTemplate | None,
             tokenizer) -> list[tuple[int, ...]]:
  """The ids each record's completions end at: the tokenizer's EOS ids; for a chat record, and
  its template's end of turn, as the server's chat endpoint stops."""
  return [tokenizer.stop_ids if record.messages is None else
          prompt_tokens.reply_stop_ids(template, tokenizer, record.messages, record.where)
          for record in records]


def _gathered(rows: Sequence[int], mine: dict[str, np.ndarray],
              count: int) -> dict[str, np.ndarray]:
  """Every row's values, from each process's own `rows` (one all-gather a generation)."""
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  names = sorted(mine)
  # [scored, each value] x every row: the same shape on every process.
  table = np.zeros((len(names) + 1, count), np.float32)
  table[:, list(rows)] = np.stack([np.ones(len(rows), np.float32),
                                   *(mine[name].astype(np.float32) for name in names)])
  values = np.zeros_like(table)
  for theirs in np.asarray(multihost_utils.process_allgather(table)).reshape(-1, *table.shape):
    values[:, theirs[0] > 0] = theirs[:, theirs[0] > 0]
  if not values[0].all():  # Every row is some process's: the batch's sharding covers it.
    raise UserError(f"rows {np.flatnonzero(values[0] == 0).tolist()} of the rollouts were "
                    f"scored by no process")
  return dict(zip(names, values[1:]))


def _local_rows(sharding: jax.sharding.Sharding, rows: int, seq_len: int) -> list[int]:
  """The rows of a [rows, seq_len] batch that this process's devices hold."""
  return sorted({row for index in sharding.addressable_devices_indices_map((rows, seq_len)).values()
                 for row in range(*index[0].indices(rows))})


def _check_room(record: PromptRecord, prompt: Sequence[int], max_tokens: int, context: int):
  if len(prompt) + max_tokens > context:
    raise UserError(f"{record.where}: a prompt of {len(prompt)} tokens leaves no room for "
                    f"{max_tokens} completion tokens (config.rl.max_completion_tokens) in the "
                    f"context of {context} tokens")


def _completion(request: Request, record: PromptRecord) -> list[int]:
  """The completion's tokens, with the stop id that ended it."""
  if request.finish_reason not in ("stop", "length"):  # The engine logged why.
    raise UserError(f"{record.where}: a completion of this prompt failed (finish_reason "
                    f"{request.finish_reason!r}); the log above says why")
  return request.tokens + ([] if request.stop_id is None else [request.stop_id])


def _common_fields(records: Sequence[PromptRecord]) -> list[str]:
  """The fields every record has: those a reward may be given."""
  names = set(records[0].fields)
  for record in records[1:]:
    names &= set(record.fields)
  return sorted(names)


@dataclasses.dataclass(frozen=True)
class RunPrompts:
  """What a GRPO run samples from, read and checked as it starts, before any model is built."""
  records: list[PromptRecord]
  tokens: list[list[int]]  # Each record's prompt, encoded.
  stop_ids: list[tuple[int, ...]]  # The ids each record's completions end at (stop_ids').
  rewards: list[rewards_lib.Reward]
  tokenizer: Any


def read_prompts(run: Any) -> RunPrompts:
  """config.rl's prompts, rewards and settings of `run` (config.settings.RunConfig) with
  config.data.tokenizer and its chat template, each mistake one line: a run learns of a bad
  reward or prompt in seconds, not after its model has loaded and its step compiled."""
  cfg = run.rl
  if run.trainer.spike_policy == "rollback":  # It would sample the rolled-back batches again.
    raise UserError("config.trainer.spike_policy 'rollback' skips the batches of datasets; a "
                    "GRPO run samples its own: use 'skip' or 'none'")
  if run.trainer.num_train_steps % cfg.updates_per_batch:
    raise UserError(f"config.trainer.num_train_steps ({run.trainer.num_train_steps}) must be a "
                    f"multiple of config.rl.updates_per_batch ({cfg.updates_per_batch}): a "
                    f"run ends, and saves, after a generation's last update")
  tokenizer = tokenizers.ending_documents(tokenizers.load_tokenizer(run.data.tokenizer))
  if tokenizer.vocab_size > run.model.vocab_size:
    raise UserError(f"config.model.vocab_size ({run.model.vocab_size}) is smaller than the "
                    f"vocabulary of config.data.tokenizer ({tokenizer.vocab_size})")
  try:
    template = chat.load_template(run.data.tokenizer, "")
  except UserError:  # Then a chat record is refused by its line.
    template = None
  rewards = [rewards_lib.load(name, weight) for name, weight in grpo.parse_rewards(cfg.rewards)]
  records = rl_prompts.read(cfg.prompts, template, rewards)
  # After an EOS, as the loader puts one before every document the model trained on.
  tokens = prompt_tokens.encode(tokenizer, [record.text for record in records], bos=True)
  for record, prompt in zip(records, tokens):  # Each said now, not when drawn.
    _check_room(record, prompt, cfg.max_completion_tokens, run.model.seq_len)
  return RunPrompts(records, tokens, stop_ids(records, template, tokenizer), rewards, tokenizer)


def check_batch_size(batch_size: int, group_size: int) -> None:
  if batch_size % group_size:
    raise UserError(f"config.trainer.batch_size ({batch_size}) must be a multiple of "
                    f"config.rl.group_size ({group_size}): each step trains on whole groups")


@dataclasses.dataclass(frozen=True)
class Sampler:
  """Where a run's rollouts are sampled: the engine, the batch rows this process samples and
  scores (None: every row), the context its steps run in (a mesh and axis rules of its own),
  and the run's params as the engine takes them."""
  engine: Engine
  rows: list[int] | None = None
  context: Callable[[], ContextManager] = contextlib.nullcontext
  params_of: Callable[[Any], Any] = lambda params: params

  @classmethod
  def on_run_mesh(cls, run: Any, steps: Any, tokenizer) -> "Sampler":
    """One process: every row, on the run's mesh, the params in the train state's layout."""
    return cls(Engine(run.model, None, slots=run.trainer.batch_size, tokenizer=tokenizer,
                      param_shardings=steps.state_shardings.model_params,
                      batch_sharding=steps.batch_sharding))

  @classmethod
  def per_process(cls, run: Any, steps: Any, tokenizer) -> "Sampler":
    """Several processes: this one's rows, on its own devices (a mesh of (data, model), the
    model split as the run's tensor axis splits it where that fits within a process, by the
    family's partition rules), the params copied to it once a generation (so they must fit a
    process's devices so split). Where the run's tensor axis spans processes, each holds, and
    samples, the same rows: the same program and seeds sample the same completions."""
    rows = _local_rows(steps.batch_sharding, run.trainer.batch_size, run.model.seq_len)
    run_mesh = steps.batch_sharding.mesh
    tensor = partitioning.axes_size(run_mesh, tuple(
        a for a in partitioning.axes_of(run.sharding.tensor_axis) if a in run_mesh.shape))
    local = jax.local_device_count()
    mesh = partitioning.make_mesh(
        (("data", -1), ("model", tensor if local % tensor == 0 else 1)), jax.local_devices())
    partitioner = partitioning.Partitioner(
        mesh, partitioning.ShardingConfig(rules=models.family(run.model).partition_rules))
    engine_shardings = partitioner.param_shardings(steps.abstract_state.model_params)
    with partitioner.activation_context():
      engine = Engine(run.model, None, slots=len(rows), tokenizer=tokenizer,
                      param_shardings=engine_shardings,
                      batch_sharding=partitioner.batch_sharding())
    replicate = jax.jit(lambda x: x, out_shardings=jax.sharding.NamedSharding(
        run_mesh, jax.sharding.PartitionSpec()))

    def params_of(params):
      """The params laid out for the engine a tensor at a time: each device holds one tensor
      whole beyond the engine's copy, not every tensor at once."""
      leaves, structure = jax.tree.flatten(params)
      return structure.unflatten([
          jax.device_put(replicate(leaf).addressable_data(0), sharding)
          for leaf, sharding in zip(leaves, jax.tree.leaves(engine_shardings))])
    return cls(engine, rows, partitioner.activation_context, params_of)


class RolloutBatches:
  """GRPO's training batches for a run (see the module's docstring).

  sampler: where they are sampled, with the params it is given; prompts: each record's
  tokens; stop_ids: the ids each record's completions end at; position: the prompts the run
  trained on before (its checkpoint's); log_probs: (params, tokens) -> each target's
  log-probability (step.ShardedSteps'), the sampling policy's, which the ratio of every update
  on the batch divides by; sharding: the batch's.
  """

  def __init__(self, cfg: grpo.GrpoConfig, sampler: Sampler, records: Sequence[PromptRecord],
               prompts: Sequence[Sequence[int]], stop_ids: Sequence[tuple[int, ...]],
               rewards: Sequence[rewards_lib.Reward], *, seed: int, seq_len: int,
               batch_size: int, position: int,
               log_probs: Callable[[Any, jax.Array], jax.Array],
               sharding: jax.sharding.Sharding):
    check_batch_size(batch_size, cfg.group_size)
    self._cfg, self._sampler, self._records, self._prompts = cfg, sampler, records, prompts
    self._stop_ids = stop_ids
    self._rewards, self._seed, self._seq_len = rewards, seed, seq_len
    self._log_probs, self._sharding = log_probs, sharding
    self.prompts_per_batch = batch_size // cfg.group_size
    self._sampling = SamplingParams(max_tokens=cfg.max_completion_tokens,
                                    temperature=cfg.temperature, top_p=cfg.top_p)
    self._generation, self._batch = None, None
    # The run position of the first prompt of the generation sampled last, and of the next's.
    self._first, self._next_first = position, position

  @classmethod
  def for_run(cls, run: Any, steps: Any, prompts: "RunPrompts",
              position: DataPosition) -> "RolloutBatches":
    """The batches of `run` (config.settings.RunConfig) on `prompts` (read_prompts'), for
    `steps` (step.ShardedSteps: their mesh and log_probs), after the prompts `position`
    counts."""
    sampler = (Sampler.on_run_mesh if jax.process_count() == 1 else Sampler.per_process)(
        run, steps, prompts.tokenizer)
    if sampler.rows is not None:
      logging.info("This process samples and scores %d of each generation's %d completions",
                   len(sampler.rows), run.trainer.batch_size)
    return cls(run.rl, sampler, prompts.records, prompts.tokens, prompts.stop_ids,
               prompts.rewards, seed=run.trainer.seed, seq_len=run.model.seq_len,
               batch_size=run.trainer.batch_size, position=position.windows,
               log_probs=steps.log_probs, sharding=steps.batch_sharding)

  def next(self, step_num: int, state: Any) -> tuple[Batch, DataPosition, dict[str, float]]:
    """The training loop's input: step `step_num`'s batch, the prompts trained on so far as
    its position, and the rollouts' metrics where it generated (`batch`)."""
    batch, metrics = self.batch(step_num, state.model_params)
    return batch, DataPosition(self._first + self.prompts_per_batch, {}), metrics

  def ends_generation(self, step_num: int) -> bool:
    """Whether step `step_num` is its generation's last update: a checkpoint or a stop falls
    there, so that a resume generates the next batch from the params it restores."""
    return step_num % self._cfg.updates_per_batch == 0

  def metrics(self, position: DataPosition) -> dict[str, float]:
    return {"rl/prompts": float(position.windows)}

  def close(self) -> None:
    self._sampler.engine.reset("closed")

  def batch(self, step_num: int, params: Any) -> tuple[Batch, dict[str, float]]:
    """Step `step_num`'s batch, and the rollouts' metrics (rl/...) where it was generated now
    ({} else): a new generation from `params` (the model's, as the step starts) at the first
    step of one; else the batch the generation gave."""
    generation = (step_num - 1) // self._cfg.updates_per_batch
    if generation == self._generation:
      return self._batch, {}
    if (step_num - 1) % self._cfg.updates_per_batch:
      raise UserError(f"step {step_num} falls within a generation of config.rl.updates_per_batch "
                      f"({self._cfg.updates_per_batch}) steps that this run did not sample: "
                      f"resume with the updates_per_batch its checkpoints were written with")
    first = self._next_first
    positions = range(first, first + self.prompts_per_batch)
    indices = [self._prompt_index(p) for p in positions]
    started = time.perf_counter()
    sampler = self._sampler
    engine_params = sampler.params_of(params)
    with sampler.context():
      sampler.engine.use_params(engine_params)
      del engine_params
      rollouts = sample(sampler.engine, [self._records[i] for i in indices],
                        [self._prompts[i] for i in indices], [self._stop_ids[i] for i in indices],
                        positions, self._cfg.group_size, self._sampling, self._seed,
                        self._rewards, self._cfg.scale_rewards, self._seq_len, sampler.rows)
      # Gives its cache's (and a params' copy's) memory back to training.
      sampler.engine.reset("generation finished")
      sampler.engine.use_params(None)
    tokens = self._put(rollouts.tokens)
    self._batch = {"tokens": tokens, "loss_weights": self._put(rollouts.loss_weights),
                   "advantages": self._put(rollouts.advantages),
                   "old_log_probs": self._log_probs(params, tokens)}
    self._generation, self._first = generation, first
    self._next_first = first + self.prompts_per_batch
    return self._batch, {**rollouts.metrics,
                         "rl/rollout_seconds": time.perf_counter() - started}

  def _prompt_index(self, position: int) -> int:
    epoch, offset = divmod(position, len(self._records))
    return int(_permutation(self._seed, epoch, len(self._records))[offset])

  def _put(self, values: np.ndarray) -> jax.Array:
    """The global batch entry, each process placing the rows its devices hold (those it
    sampled)."""
    return jax.make_array_from_callback(values.shape, self._sharding, lambda index: values[index])


@functools.lru_cache(maxsize=4)
def _permutation(seed: int, epoch: int, count: int) -> np.ndarray:
  """The order of the prompts in pass `epoch` over them."""
  return np.random.default_rng([seed, epoch]).permutation(count)
