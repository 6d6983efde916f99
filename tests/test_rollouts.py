"""GRPO's rollouts: groups sampled by the engine, laid out as a training batch, scored, and the
same for the same run position whatever else is sampled with them."""
import sys
import types

import numpy as np
import pytest

from levanter_flax.core.errors import UserError
from levanter_flax.data.rl_prompts import PromptRecord
from levanter_flax.generate.engine import Engine, SamplingParams
from levanter_flax.objectives import grpo, rewards
from levanter_flax.training import rollouts
from test_engine import ByteText, random_model

SEQ_LEN = 24  # test_sample's models'.
PROMPTS = [[3, 14, 15, 9], [8, 9], [1, 2, 3, 4, 5, 6], [40, 41, 42]]


def letters(completions, answer, **_):
  """How many of the answer's letters the completion holds."""
  return [float(sum(ch in c for ch in a)) for c, a in zip(completions, answer)]


@pytest.fixture(scope="module")
def engine():
  cfg, params = random_model()
  return Engine(cfg, params, slots=8, prefill_chunk=8, tokenizer=ByteText())


def sample(engine, positions, group_size=4, sampling=None, **overrides):
  sys.modules["rollout_rewards"] = types.SimpleNamespace(letters=letters)
  records = [PromptRecord(ByteText().decode(PROMPTS[p]), {"answer": "abcdefg"[p:p + 3]},
                          f"prompts.jsonl line {p + 1}") for p in positions]
  return rollouts.sample(
      engine, records, [PROMPTS[p] for p in positions], positions, group_size,
      sampling or SamplingParams(max_tokens=6, temperature=1.0, stop_ids=(7,)), seed=3,
      rewards=[rewards.load("rollout_rewards:letters")], scale_rewards="group", seq_len=SEQ_LEN,
      **overrides)


def test_a_batch_of_groups(engine):
  got = sample(engine, [0, 1, 2, 3])
  assert got.tokens.shape == got.loss_weights.shape == (16, SEQ_LEN)
  stopped = 0
  for row in range(16):
    prompt = PROMPTS[row // 4]
    assert got.tokens[row, :len(prompt)].tolist() == prompt
    weighted = np.flatnonzero(got.loss_weights[row])
    completion = got.tokens[row, weighted].tolist()
    # The completion's tokens, right after the prompt, a stop token only as their last.
    assert weighted.tolist() == list(range(len(prompt), len(prompt) + len(completion)))
    assert 1 <= len(completion) <= 7 and 7 not in completion[:-1]
    stopped += completion[-1] == 7
    assert not got.tokens[row, len(prompt) + len(completion):].any()
  assert 0 < stopped < 16  # Some stopped at token 7 (kept, so the policy learns to stop).
  text = [ByteText().decode(t for t in got.tokens[r, np.flatnonzero(got.loss_weights[r])]
                            if t != 7) for r in range(16)]
  np.testing.assert_array_equal(got.rewards, letters(text, [a for a in ["abc", "bcd", "cde", "def"]
                                                            for _ in range(4)]))
  np.testing.assert_allclose(got.advantages, grpo.group_advantages(got.rewards, 4, "group"))
  assert got.metrics["rl/reward_mean"] == pytest.approx(got.rewards.mean())
  assert got.metrics["rl/stopped_fraction"] == stopped / 16
  # The group's completions differ: each has its own seed.
  assert len({tuple(got.tokens[r]) for r in range(4)}) > 1


def test_a_position_samples_the_same_in_any_batch(engine):
  """A resumed run samples at position 2 what the uninterrupted one did."""
  whole = sample(engine, [0, 1, 2, 3])
  alone = sample(engine, [2, 3])
  np.testing.assert_array_equal(alone.tokens, whole.tokens[8:])
  other_seed = rollouts.completion_seed(4, 2, 0)
  assert other_seed != rollouts.completion_seed(3, 2, 0) != rollouts.completion_seed(3, 3, 0)


def test_a_prompt_too_long_for_its_completion_is_one_line(engine):
  with pytest.raises(UserError) as raised:
    sample(engine, [2], sampling=SamplingParams(max_tokens=20))
  assert str(raised.value) == ("prompts.jsonl line 3: a prompt of 6 tokens leaves no room for 20 "
                               "completion tokens (config.rl.max_completion_tokens) in the context of 24 "
                               "tokens")
