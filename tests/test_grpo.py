"""GRPO's loss equals TRL's GRPOTrainer's (each aggregation, with and without the KL), its group
advantages the plain statement of them, and rewards: built in, by import path, weighted, and
each way one can fail in one line."""
import concurrent.futures
import statistics
import sys
import types
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from levanter_flax.core.errors import UserError
from levanter_flax.data import chat, rl_prompts
from levanter_flax.objectives import grpo, rewards
from test_chat import CHATML as CHATML_SOURCE

trl = pytest.importorskip("trl")

COMPLETIONS, TOKENS, MAX_TOKENS = 6, 7, 9
CHATML = chat.ChatTemplate(CHATML_SOURCE, "chatml", ())


def batch(seed=0):
  rng = np.random.default_rng(seed)
  old = rng.normal(-2, 0.5, (COMPLETIONS, TOKENS)).astype(np.float32)
  # Ratios from 0.5 to 1.6: both clips are reached.
  log_probs = (old + rng.uniform(-0.7, 0.5, old.shape)).astype(np.float32)
  reference = (old + rng.normal(0, 0.3, old.shape)).astype(np.float32)
  advantages = rng.normal(0, 1, COMPLETIONS).astype(np.float32)
  lengths = [7, 3, 1, 5, 0, 6]  # A completion of no tokens too.
  mask = (np.arange(TOKENS)[None] < np.array(lengths)[:, None]).astype(np.float32)
  return log_probs, old, reference, advantages, mask


def trl_loss(cfg: grpo.GrpoConfig, log_probs, old, reference, advantages, mask):
  """TRL's GRPOTrainer._compute_loss on these log-probabilities (its model call replaced), and
  its gradient with respect to them."""
  policy = torch.tensor(log_probs, dtype=torch.float64, requires_grad=True)
  accelerator = types.SimpleNamespace(gather=lambda x: x, reduce=lambda x, reduction: x,
                                      gather_for_metrics=lambda x: x, num_processes=1,
                                      sync_gradients=True)
  trainer = types.SimpleNamespace(
      _get_per_token_logps_and_entropies=lambda *a, **k: (policy, torch.zeros_like(policy), None),
      top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token",
      beta=cfg.beta, loss_type=cfg.loss_type, epsilon_low=cfg.epsilon_low,
      epsilon_high=cfg.epsilon_high, use_vllm=False, vllm_importance_sampling_correction=False,
      model=types.SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
      max_completion_length=MAX_TOKENS, _entropy_bonus_enabled=False, aux_loss_enabled=False,
      _metrics={"train": defaultdict(list)}, accelerator=accelerator,
      args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None))
  as_torch = lambda x: torch.tensor(x, dtype=torch.float64)
  inputs = {"prompt_ids": torch.zeros(COMPLETIONS, 2, dtype=torch.long),
            "prompt_mask": torch.ones(COMPLETIONS, 2, dtype=torch.long),
            "completion_ids": torch.zeros(COMPLETIONS, TOKENS, dtype=torch.long),
            "completion_mask": as_torch(mask), "advantages": as_torch(advantages),
            "old_per_token_logps": as_torch(old), "ref_per_token_logps": as_torch(reference)}
  loss = trl.GRPOTrainer._compute_loss(trainer, None, inputs)
  loss.backward()
  return float(loss.detach()), policy.grad.numpy(), trainer._metrics["train"]


def our_loss(cfg, log_probs, old, reference, advantages, mask):
  def loss(log_probs):
    losses, metrics = grpo.per_token_losses(log_probs, old, reference, advantages, cfg)
    return grpo.aggregate(losses, mask, cfg.loss_type, MAX_TOKENS), metrics
  (value, metrics), gradient = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(log_probs))
  return float(value), np.asarray(gradient), {k: float(grpo.token_mean(v, mask))
                                               for k, v in metrics.items()}


@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_the_loss_and_its_gradient_equal_trls(loss_type, beta):
  cfg = grpo.GrpoConfig(loss_type=loss_type, beta=beta, epsilon_low=0.2, epsilon_high=0.28)
  inputs = batch()
  theirs, their_gradient, their_metrics = trl_loss(cfg, *inputs)
  ours, our_gradient, our_metrics = our_loss(cfg, *inputs)
  assert abs(ours - theirs) < 1e-6
  np.testing.assert_allclose(our_gradient, their_gradient, atol=1e-7)
  assert their_metrics["clip_ratio/low_mean"][0] > 0
  assert their_metrics["clip_ratio/high_mean"][0] > 0
  for ours_name, their_name in [("clip_low", "clip_ratio/low_mean"),
                                ("clip_high", "clip_ratio/high_mean"),
                                ("clip_region", "clip_ratio/region_mean")] + (
                                    [("kl", "kl")] if beta else []):
    assert abs(our_metrics[ours_name] - their_metrics[their_name][0]) < 1e-6, ours_name


def test_the_loss_types_differ_and_a_clip_changes_it():
  """So that the parity above could fail: each aggregation gives another number, and so does
  another clip."""
  inputs = batch(1)
  values = {t: our_loss(grpo.GrpoConfig(loss_type=t), *inputs)[0] for t in grpo.LOSS_TYPES}
  assert len({round(v, 6) for v in values.values()}) == 3
  assert our_loss(grpo.GrpoConfig(epsilon_high=0.5), *inputs)[0] != values["grpo"]


def rollout_rows(rows: int, seq_len: int, rng: np.random.Generator):
  """Rows of a prompt then a completion of 1 to seq_len - 3 tokens (zeros after), with their
  completion mask as loss weights."""
  tokens = rng.integers(1, 64, (rows, seq_len)).astype(np.int32)
  weights = np.zeros((rows, seq_len), np.float32)
  for row in range(rows):
    start, length = rng.integers(1, 3), rng.integers(1, seq_len - 3)
    weights[row, start:start + length] = 1
    tokens[row, start + length:] = 0
  return tokens, weights


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
def test_the_step_trains_grpo_as_numpy_states_it_and_exactly_under_accumulation(loss_type):
  """The train step's GRPO loss on a model's log-probabilities (from NumPy's log-softmax of its
  logits) is aggregate's of per_token_losses', and accumulation changes neither it nor the
  gradient: each microbatch divides by the whole batch's completions and tokens."""
  from levanter_flax.models.gpt2 import GPT2LMHeadModel
  from levanter_flax.training import step
  from test_dpo import TINY
  rng = np.random.default_rng(0)
  model = GPT2LMHeadModel(TINY)
  tokens, weights = rollout_rows(8, TINY.seq_len, rng)
  params = model.init(jax.random.key(0), jnp.asarray(tokens))["params"]
  reference = model.init(jax.random.key(1), jnp.asarray(tokens))["params"]
  logits = lambda p: np.asarray(model.apply({"params": p}, jnp.asarray(tokens)), np.float64)
  log_probs = lambda p: np.take_along_axis(
      jax.nn.log_softmax(logits(p)[:, :-1]), tokens[:, 1:, None], -1)[..., 0]
  old = (log_probs(params) + rng.normal(0, 0.2, tokens[:, 1:].shape)).astype(np.float32)
  advantages = rng.normal(0, 1, 8).astype(np.float32)
  batch = {"tokens": tokens, "loss_weights": weights, "advantages": advantages,
           "old_log_probs": old}
  objective = grpo.Grpo(grpo.GrpoConfig(loss_type=loss_type, beta=0.04, max_completion_tokens=12))
  mask = weights[:, 1:]
  losses, metrics = grpo.per_token_losses(jnp.asarray(log_probs(params), jnp.float32), old,
                                          jnp.asarray(log_probs(reference), jnp.float32),
                                          advantages, objective.cfg)
  expected = float(grpo.aggregate(losses, mask, loss_type, 12))
  grads = {}
  for microbatches in (1, 2, 4):
    parts, grads[microbatches] = jax.jit(lambda p, b, n=microbatches: (
        step.accumulated_loss_and_grads(model, p, b, n, objective=objective,
                                        reference=step.Reference(model, reference))))(
            params, batch)
    assert float(parts["loss"]) == pytest.approx(expected, rel=1e-4, abs=1e-6), microbatches
    for name, values in metrics.items():
      assert float(parts[f"grpo/{name}"]) == pytest.approx(
          float(grpo.token_mean(values, mask)), rel=1e-4, abs=1e-6), (name, microbatches)
  assert float(parts["grpo/kl"]) > 0
  for microbatches in (2, 4):
    for got, want in zip(jax.tree.leaves(grads[microbatches]), jax.tree.leaves(grads[1])):
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-7)


def test_group_advantages_are_the_groups_standardized_rewards():
  rng = np.random.default_rng(0)
  rewards_ = rng.integers(0, 3, 12).astype(np.float32).tolist()
  rewards_[4:8] = [1.0] * 4  # A group whose rewards are equal: advantages 0, not NaN.
  got = grpo.group_advantages(np.array(rewards_), 4, "group")
  unscaled = grpo.group_advantages(np.array(rewards_), 4, "none")
  for g in range(3):
    group = rewards_[4 * g:4 * g + 4]
    mean, stdev = statistics.mean(group), statistics.stdev(group)
    for i, reward in enumerate(group):
      assert got[4 * g + i] == pytest.approx((reward - mean) / (stdev + 1e-4), abs=1e-6)
      assert unscaled[4 * g + i] == pytest.approx(reward - mean, abs=1e-6)
  assert not got[4:8].any()
  with pytest.raises(UserError, match=r"^rl.group_size must be at least 2: .*; got 1$"):
    grpo.group_advantages(np.array(rewards_), 1, "group")
  # TRL's own standard deviation (Bessel-corrected, as statistics.stdev).
  their_std = trl.trainer.utils.nanstd(torch.tensor(rewards_).view(-1, 4), dim=1).numpy()
  np.testing.assert_allclose(their_std, [statistics.stdev(rewards_[i:i + 4])
                                         for i in (0, 4, 8)], atol=1e-6)


def test_the_built_in_rewards_and_weights():
  exact = rewards.load("exact_match", weight=2.0)
  maths = rewards.load("math_answer", weight=0.5)
  total, each = rewards.score([exact, maths], [" 42 ", "\\frac{1}{2}", "7"], ["p"] * 3,
                              {"answer": ["42", "0.5", "8"], "id": [1, 2, 3]})
  assert each["exact_match"].tolist() == [1, 0, 0]
  assert each["math_answer"].tolist() == [1, 1, 0]
  assert total.tolist() == [2.5, 0.5, 0.0]
  # Off the main thread (a server's, a harness's), where math-verify's timeout cannot run.
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    assert pool.submit(rewards.math_answer, ["\\boxed{4}", "5"], ["4", "4"]).result() == [1, 0]


def _module(**functions):
  module = types.ModuleType("user_rewards")
  module.__dict__.update(functions)
  sys.modules["user_rewards"] = module
  return module


@pytest.mark.parametrize("function,message", [
    (lambda completions, **_: 1 / 0,
     "reward user_rewards:f raised ZeroDivisionError: division by zero"),
    (lambda completions, **_: [float("nan")] * len(completions),
     "reward user_rewards:f returned nan for completion 0: rewards must be finite"),
    (lambda completions, **_: [1.0], "reward user_rewards:f returned 1 values for 2 completions"),
    (lambda completions, **_: [1.0, "yes"],
     "reward user_rewards:f returned 'yes' (str) for completion 1: not a number"),
    (lambda completions, **_: 3.0, "reward user_rewards:f returned float, not one number per "
                                   "completion"),
    (lambda completions, **_: np.array([1.0, 1j]),
     "reward user_rewards:f returned np.complex128(1+0j) (complex128) for completion 0: not a "
     "number"),
])
def test_a_reward_that_fails_is_one_line_naming_it(function, message):
  _module(f=function)
  with pytest.raises(UserError) as raised:
    rewards.score([rewards.load("user_rewards:f")], ["a", "b"], ["p", "q"], {})
  assert str(raised.value) == message


def test_a_reward_that_cannot_be_loaded_is_one_line():
  _module(g=lambda completions, **_: [0.0] * len(completions), value=3)
  with pytest.raises(UserError, match=r"^reward 'no_such_module:f': module no_such_module "
                                      r"cannot be imported: ModuleNotFoundError"):
    rewards.load("no_such_module:f")
  with pytest.raises(UserError, match="^reward 'user_rewards:value': user_rewards has no "
                                      "function value$"):
    rewards.load("user_rewards:value")
  with pytest.raises(UserError, match="^reward 'no_such_reward': levanter_flax.objectives"
                                      ".rewards has no function no_such_reward$"):
    rewards.load("no_such_reward")


def test_records_must_have_the_fields_their_rewards_take(tmp_path):
  def solved(completions, answer, difficulty, **kwargs):
    return [float(d) for d in difficulty]
  _module(solved=solved)
  reward = rewards.load("user_rewards:solved")
  assert reward.fields == ("answer", "difficulty")
  lines = ['{"prompt": "1+1=", "answer": "2", "difficulty": 1}',
           '{"messages": [{"role": "user", "content": "2+2?"}], "answer": "4", "difficulty": 2}',
           '', '{"prompt": "3+3=", "answer": "6"}']
  path = tmp_path / "prompts.jsonl"
  path.write_text("\n".join(lines))
  with pytest.raises(UserError) as raised:
    rl_prompts.read(str(path), CHATML, [reward])
  assert str(raised.value) == (f"{path} line 4: reward user_rewards:solved takes the field(s) "
                               "difficulty, which this record does not have")
  path.write_text("\n".join(lines[:3]))
  records = rl_prompts.read(str(path), CHATML, [reward])
  assert [r.text for r in records] == ["1+1=", "<|im_start|>user\n2+2?<|im_end|>\n"
                                       "<|im_start|>assistant\n"]
  assert records[1].fields == {"answer": "4", "difficulty": 2}
  # A parameter with a default is given where the records have it, and not required.
  def matches(completions, answer=None):
    return [float(c == answer_) for c, answer_ in zip(completions, answer)]
  _module(matches=matches)
  optional = rewards.load("user_rewards:matches")
  assert optional.fields == () and optional.parameters == ("answer",)
  assert rewards.score([optional], ["x", "y"], ["p", "q"], {"answer": ["x", "z"]})[0].tolist() == [
      1.0, 0.0]
  # A function with **kwargs gets every field; one without gets only those it names.
  total, _ = rewards.score([reward], ["a"], ["p"], {"answer": ["x"], "difficulty": [3],
                                                      "other": [0]})
  assert total.tolist() == [3.0]


@pytest.mark.parametrize("line,message", [
    ('{"prompt": "a"', "not JSON (Expecting ',' delimiter, column 15)"),
    ('["a"]', "a record must be a JSON object, not list"),
    ('{"answer": "2"}', 'a record needs "prompt" (text) or "messages" (a chat), one of them; it '
                        'has neither'),
    ('{"prompt": "a", "messages": []}', 'a record needs "prompt" (text) or "messages" (a chat), '
                                        'one of them; it has prompt and messages'),
    ('{"prompt": 3}', '"prompt" must be non-empty text'),
    ('{"messages": "hi"}', 'a chat record needs "messages": a list of objects with a "role" and '
                           '"content"'),
])
def test_a_bad_prompt_record_is_one_line_naming_its_line(line, message, tmp_path):
  path = tmp_path / "prompts.jsonl"
  path.write_text('{"prompt": "fine"}\n' + line + "\n")
  with pytest.raises(UserError) as raised:
    rl_prompts.read(str(path), CHATML)
  assert str(raised.value) == f"{path} line 2: {message}"


def test_a_missing_empty_or_undecodable_prompts_file_is_one_line(tmp_path):
  with pytest.raises(UserError, match=f"^the prompts file {tmp_path}/none.jsonl does not exist$"):
    rl_prompts.read(str(tmp_path / "none.jsonl"), None)
  (tmp_path / "empty.jsonl").write_text("\n\n")
  with pytest.raises(UserError, match="holds no records$"):
    rl_prompts.read(str(tmp_path / "empty.jsonl"), None)
  (tmp_path / "latin1.jsonl").write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')
  with pytest.raises(UserError, match=r"latin1.jsonl line 2: not UTF-8 text \(byte 0xe9\)$"):
    rl_prompts.read(str(tmp_path / "latin1.jsonl"), None)
  (tmp_path / "chat.jsonl").write_text('{"messages": [{"role": "user", "content": "x"}]}')
  with pytest.raises(UserError, match="line 1: a chat record needs a chat template"):
    rl_prompts.read(str(tmp_path / "chat.jsonl"), None)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_step_scores_completions_at_the_sampling_temperature_as_trl_does(tmp_path,
                                                                             temperature):
  """TRL's GRPOTrainer takes the policy's, the sampler's (old) and the reference's log-probs
  from logits / temperature (its fused LM head's); so do the step's loss and its log_probs."""
  import contextlib
  import transformers
  from levanter_flax import models
  from levanter_flax.hf import snapshot
  from levanter_flax.training import step
  from trl.trainer.grpo_trainer import add_fused_lm_head
  torch.manual_seed(0)
  policy, reference = (transformers.GPT2LMHeadModel(transformers.GPT2Config(
      vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
      eos_token_id=0)).eval() for _ in range(2))
  ours = {}
  for name, hf in (("policy", policy), ("reference", reference)):
    hf.save_pretrained(tmp_path / name)
    ours[name] = snapshot.load(tmp_path / name)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 64, (COMPLETIONS, 12)).astype(np.int32)
  trainer = types.SimpleNamespace(accelerator=types.SimpleNamespace(
      autocast=contextlib.nullcontext, is_main_process=True))

  def trl_log_probs(hf):
    add_fused_lm_head(hf, temperature=temperature)
    ids = torch.tensor(tokens, dtype=torch.long)
    with torch.no_grad():
      return trl.GRPOTrainer._get_per_token_logps_and_entropies(
          trainer, hf, ids, torch.ones_like(ids), logits_to_keep=tokens.shape[1] - 1)[0].numpy()

  theirs = {name: trl_log_probs(hf) for name, hf in (("policy", policy),
                                                      ("reference", reference))}
  cfg = grpo.GrpoConfig(temperature=temperature, beta=0.04, max_completion_tokens=TOKENS)
  objective = grpo.Grpo(cfg)
  model = models.build(ours["policy"][0])
  got = -step._token_losses(model, ours["policy"][1], jnp.asarray(tokens), None,
                            temperature=objective.logit_temperature)[0]
  np.testing.assert_allclose(np.asarray(got), theirs["policy"], atol=2e-5)
  # The loss, with the sampler's log-probs as TRL's policy's at sampling time, plus noise.
  old = theirs["policy"] + rng.normal(0, 0.2, theirs["policy"].shape).astype(np.float32)
  mask = np.zeros(tokens.shape, np.float32)
  mask[:, 4:4 + TOKENS] = 1
  advantages = rng.normal(0, 1, COMPLETIONS).astype(np.float32)
  batch = {"tokens": jnp.asarray(tokens), "loss_weights": jnp.asarray(mask),
           "advantages": jnp.asarray(advantages), "old_log_probs": jnp.asarray(old)}
  value = step.loss_and_parts(model, ours["policy"][1], batch, objective=objective,
                              reference=step.Reference(model, ours["reference"][1]))[1]["loss"]
  their_value = trl_loss(cfg, theirs["policy"][:, 3:3 + TOKENS], old[:, 3:3 + TOKENS],
                         theirs["reference"][:, 3:3 + TOKENS], advantages,
                         np.ones((COMPLETIONS, TOKENS), np.float32))[0]
  assert float(value) == pytest.approx(their_value, abs=2e-5)
  # So that this could fail: at another temperature the log-probs differ.
  other = -step._token_losses(model, ours["policy"][1], jnp.asarray(tokens), None,
                              temperature=temperature + 0.3)[0]
  assert np.abs(np.asarray(other) - theirs["policy"]).max() > 1e-2


def test_a_temperature_of_zero_is_refused():
  with pytest.raises(UserError, match="config.rl.temperature must be above 0: at 0 \\(greedy\\)"):
    grpo.GrpoConfig(temperature=0.0)
