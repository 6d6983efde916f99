"""GRPO's rollouts: each prompt's group of completions, sampled by the generation engine from
the current params, scored by the rewards and turned into a training batch.

A batch row is a prompt and one of its completions, with the stop token that ended it (so the
policy learns to stop), zero-padded to seq_len; its loss weights are 1 on the completion's
tokens (as targets) and 0 elsewhere; its advantage is objectives/grpo.group_advantages' of
the group's rewards. Completion j of the prompt at run position p samples with the seed drawn
from (seed, p, j): a run resumed at p samples what it would have sampled.
"""
import dataclasses
import time
from typing import Sequence

import numpy as np

from levanter_flax.core.errors import UserError
from levanter_flax.data.rl_prompts import PromptRecord
from levanter_flax.generate.engine import Engine, Request, SamplingParams
from levanter_flax.objectives import grpo, rewards as rewards_lib


@dataclasses.dataclass(frozen=True)
class Rollouts:
  tokens: np.ndarray  # int32 [prompts x group, seq_len]: prompt, completion, stop token, zeros.
  loss_weights: np.ndarray  # float32, tokens' shape: 1 on each completion token (a target).
  advantages: np.ndarray  # float32 [prompts x group].
  rewards: np.ndarray  # float32 [prompts x group]: the weighted sums.
  metrics: dict[str, float]


def completion_seed(seed: int, position: int, index: int) -> int:
  """The sampling seed of completion `index` of the prompt at run position `position`."""
  return int(np.random.SeedSequence([seed, position, index]).generate_state(1)[0])


def sample(engine: Engine, records: Sequence[PromptRecord], prompts: Sequence[Sequence[int]],
           positions: Sequence[int], group_size: int, sampling: SamplingParams, seed: int,
           rewards: Sequence[rewards_lib.Reward], scale_rewards: str,
           seq_len: int) -> Rollouts:
  """The rollouts of `prompts` (their tokens; `records` their text and fields; `positions`
  their places in the run's order of prompts), group_size completions each."""
  for record, prompt in zip(records, prompts, strict=True):
    if len(prompt) + sampling.max_tokens > engine.max_len:
      raise UserError(f"{record.where}: a prompt of {len(prompt)} tokens leaves no room for "
                      f"{sampling.max_tokens} completion tokens (rl.max_completion_tokens) in "
                      f"the context of {engine.max_len} tokens")
  samplings = [dataclasses.replace(sampling, seed=completion_seed(seed, p, j))
               for p in positions for j in range(group_size)]
  started = time.perf_counter()
  requests = engine.generate([list(p) for p in prompts for _ in range(group_size)], samplings)
  seconds = time.perf_counter() - started
  completions = [_completion(r, records[i // group_size]) for i, r in enumerate(requests)]
  total, each = rewards_lib.score(
      rewards, [r.text for r in requests], [rec.text for rec in records for _ in range(group_size)],
      {name: [rec.fields[name] for rec in records for _ in range(group_size)]
       for name in _common_fields(records)})
  advantages = grpo.group_advantages(total, group_size, scale_rewards)
  tokens = np.zeros((len(requests), seq_len), np.int32)
  weights = np.zeros((len(requests), seq_len), np.float32)
  for row, (request, completion) in enumerate(zip(requests, completions)):
    start = len(request.prompt)
    tokens[row, :start] = request.prompt
    tokens[row, start:start + len(completion)] = completion
    weights[row, start:start + len(completion)] = 1
  lengths = np.array([len(c) for c in completions], np.float32)
  grouped = total.reshape(-1, group_size)
  metrics = {"rl/reward_mean": float(total.mean()), "rl/reward_std": float(total.std()),
             **{f"rl/reward/{name}": float(values.mean()) for name, values in each.items()},
             "rl/advantage_abs_mean": float(np.abs(advantages).mean()),
             "rl/groups_all_equal": float((grouped.max(axis=1) == grouped.min(axis=1)).mean()),
             "rl/completion_length": float(lengths.mean()),
             "rl/stopped_fraction": float(np.mean([r.stop_id is not None for r in requests])),
             "rl/generation_seconds": seconds,
             "rl/generation_tokens_per_second": float(lengths.sum() / max(seconds, 1e-9))}
  return Rollouts(tokens, weights, advantages, total, metrics)


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
