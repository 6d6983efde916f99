"""GRPO's rollouts: groups sampled by the engine, laid out as a training batch, scored, and the
same for the same run position whatever else is sampled with them."""
import sys
import types

import jax
import jax.numpy as jnp
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


def sample(engine, positions, group_size=4, sampling=None, stop_ids=(7,), **overrides):
  sys.modules["rollout_rewards"] = types.SimpleNamespace(letters=letters)
  records = [PromptRecord(ByteText().decode(PROMPTS[p]), {"answer": "abcdefg"[p:p + 3]},
                          f"prompts.jsonl line {p + 1}") for p in positions]
  return rollouts.sample(
      engine, records, [PROMPTS[p] for p in positions], [stop_ids] * len(positions), positions,
      group_size, sampling or SamplingParams(max_tokens=6, temperature=1.0), seed=3,
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


def test_a_chat_record_ends_at_its_template_end_of_turn(tmp_path):
  """A model that always ends its turn at once: a chat prompt's completions are the end of
  turn alone (the rewards see "", the loss weighs that token alone); a plain prompt's run on,
  as only an EOS ends them."""
  import dataclasses
  import json
  from levanter_flax import models
  from levanter_flax.data import chat, rl_prompts, tokenizers
  from levanter_flax.generate import prompts as prompt_tokens
  from test_chat import CHATML, make_tokenizer
  from test_sample import MODELS
  path = make_tokenizer(tmp_path, template=CHATML, eos_token="<|endoftext|>")
  tokenizer, template = tokenizers.load_tokenizer(path), chat.load_template(path, "")
  (tmp_path / "prompts.jsonl").write_text(
      json.dumps({"messages": [{"role": "user", "content": "hello"}]}) + "\n"
      + json.dumps({"prompt": "hello"}) + "\n")
  records = rl_prompts.read(str(tmp_path / "prompts.jsonl"), template)
  end_of_turn = tokenizer.encode("<|im_end|>").tolist()
  stops = rollouts.stop_ids(records, template, tokenizer)
  assert stops == [tuple(sorted({*tokenizer.stop_ids, *end_of_turn})), tokenizer.stop_ids]
  assert end_of_turn[0] not in tokenizer.stop_ids
  cfg = dataclasses.replace(MODELS["gpt2"], vocab_size=tokenizer.vocab_size, seq_len=64)
  params = models.build(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
  # The last hidden state is the final norm's bias, e_0, whatever came before: the logits are
  # the embedding's first column, the end of turn's far the largest.
  params["ln_f"] = {"scale": jnp.zeros_like(params["ln_f"]["scale"]),
                    "bias": jnp.zeros_like(params["ln_f"]["bias"]).at[0].set(1.0)}
  params["wte"]["embedding"] = params["wte"]["embedding"].at[:, 0].set(0).at[
      end_of_turn[0], 0].set(50.0)
  engine = Engine(cfg, params, slots=4, tokenizer=tokenizer)
  seen = []
  sys.modules["rollout_rewards"] = types.SimpleNamespace(
      seen=lambda completions, **_: seen.extend(completions) or [0.0] * len(completions))
  got = rollouts.sample(
      engine, records, prompt_tokens.encode(tokenizer, [r.text for r in records], bos=True),
      stops, [0, 1], 2, SamplingParams(max_tokens=6, temperature=1.0), seed=0,
      rewards=[rewards.load("rollout_rewards:seen")], scale_rewards="group", seq_len=64)
  assert seen[:2] == ["", ""]
  for row in range(2):
    assert got.tokens[row, np.flatnonzero(got.loss_weights[row])].tolist() == end_of_turn
  for row in range(2, 4):
    assert got.loss_weights[row].sum() == 6
  assert got.metrics["rl/stopped_fraction"] == 0.5
