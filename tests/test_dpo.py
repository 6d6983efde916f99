"""DPO: prepare's preference source, the loss against NumPy's, and runs that learn a preference."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from conftest import read_metrics
from levanter_flax.training import batch_search, step
from levanter_flax.objectives import dpo
from levanter_flax import models
from levanter_flax.parallel import partitioning
from levanter_flax.config import to_run_config
from levanter_flax.data.manifest import load_manifest
from levanter_flax.core.errors import UserError
from levanter_flax.models.gpt2 import GPT2Config, GPT2LMHeadModel
from levanter_flax.training.loop import train_and_evaluate
from test_chat import (documents, make_tokenizer, prepare_records,  # pylint: disable=unused-import
                       tokenizer_file, weighted_text)

TINY = GPT2Config(vocab_size=64, seq_len=16, num_layers=2, num_heads=2, hidden_dim=32)
EOS = 63


def preference_rows(rows: int, rng) -> tuple[np.ndarray, np.ndarray]:
  """Rows laid out as prepare lays out a pair (EOS prompt chosen EOS prompt rejected EOS pad),
  with their codes; replies of different lengths."""
  tokens = rng.integers(0, EOS, (rows, TINY.seq_len)).astype(np.int32)
  codes = np.zeros(tokens.shape, np.float32)
  for row in range(rows):
    chosen_len, rejected_len = 1 + row % 3, 3 - row % 3
    rejected_start = 1 + 3 + chosen_len + 1  # After EOS, prompt, chosen, EOS.
    tokens[row, [0, 4 + chosen_len]] = EOS
    tokens[row, rejected_start:rejected_start + 3] = tokens[row, 1:4]
    end = rejected_start + 3 + rejected_len
    tokens[row, end:] = EOS
    codes[row, 4:4 + chosen_len + 1] = dpo.CHOSEN
    codes[row, rejected_start + 3:end + 1] = dpo.REJECTED
  return tokens, codes


def numpy_dpo(policy_logits, reference_logits, tokens, codes, beta, smoothing) -> dict:
  """DPO's loss and metrics (means over rows) in float64 NumPy, from the two models' logits."""
  def reply_log_probs(logits):
    logits = np.asarray(logits, np.float64)[:, :-1]
    shifted = logits - logits.max(-1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    target = np.take_along_axis(log_softmax, tokens[:, 1:, None], -1)[..., 0]
    return [(target * (codes[:, 1:] == code)).sum(1) for code in (dpo.CHOSEN, dpo.REJECTED)]
  (pc, pr), (rc, rr) = reply_log_probs(policy_logits), reply_log_probs(reference_logits)
  chosen, rejected = beta * (pc - rc), beta * (pr - rr)
  margin = chosen - rejected
  log_sigmoid = lambda x: -np.logaddexp(0, -x)
  loss = -(1 - smoothing) * log_sigmoid(margin) - smoothing * log_sigmoid(-margin)
  return {"loss": loss.mean(), "dpo/reward_accuracy": (chosen > rejected).mean(),
          "dpo/margin": margin.mean(), "dpo/chosen_reward": chosen.mean(),
          "dpo/rejected_reward": rejected.mean()}


@pytest.mark.slow
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_the_dpo_loss_is_numpys_and_exact_under_accumulation(smoothing):
  model = GPT2LMHeadModel(TINY)
  tokens, codes = preference_rows(8, np.random.default_rng(0))
  params = model.init(jax.random.key(0), jnp.asarray(tokens))["params"]
  reference = model.init(jax.random.key(1), jnp.asarray(tokens))["params"]
  segments = step.segment_ids(jnp.asarray(tokens), EOS)
  logits = lambda p: model.apply({"params": p}, jnp.asarray(tokens), segment_ids=segments)
  cfg = dpo.DpoConfig(beta=0.5, label_smoothing=smoothing)
  expected = numpy_dpo(logits(params), logits(reference), tokens, codes, cfg.beta, smoothing)
  grads = {}
  for microbatches in (1, 2, 4):
    parts, grads[microbatches] = jax.jit(lambda p, t, w, n=microbatches: (
        step.accumulated_loss_and_grads(model, p, {"tokens": t, "loss_weights": w}, n, EOS,
                                        dpo.Dpo(cfg), reference=step.Reference(model, reference))))(
            params, tokens, codes)
    for name, value in expected.items():
      assert float(parts[name]) == pytest.approx(value, rel=1e-4, abs=1e-6), (name, microbatches)
  for microbatches in (2, 4):
    for got, want in zip(jax.tree.leaves(grads[microbatches]), jax.tree.leaves(grads[1])):
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-7)
  # The eval step scores each pair alike.
  pairs = step.make_eval_step(model, EOS, dpo.Dpo(cfg))((params, reference),
                                                         {"tokens": tokens, "loss_weights": codes})
  assert float(pairs["loss"].mean()) == pytest.approx(expected["loss"], rel=1e-4)


PAIRS = [
    {"prompt": "Q: hello? A:", "chosen": " hello there", "rejected": " how are you"},
    {"messages": [{"role": "user", "content": "hello"}], "chosen": "hello there, how are you",
     "rejected": [{"role": "assistant", "content": "fine é ✓"}]},
    {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and?"}],
     "chosen": [{"role": "assistant", "content": "fine"}], "rejected": "no"},
]


def test_prepare_codes_each_reply_and_its_end_and_keeps_a_pair_in_one_row(tmp_path,
                                                                          tokenizer_file):
  too_long = {"prompt": "hello there " * 80, "chosen": "a", "rejected": "b"}
  directory = prepare_records(tmp_path, "preference", PAIRS + [too_long], tokenizer_file,
                              seq_len=160)
  manifest = load_manifest(directory)
  assert (manifest["format_version"], manifest["seq_len"]) == (4, 160)
  assert manifest["source"]["pairs_too_long_skipped"] == 1
  eos = "<|endoftext|>"
  replies = [(" hello there" + eos, " how are you" + eos),
             ("hello there, how are you<|im_end|>", "fine é ✓<|im_end|>"),
             ("fine<|im_end|>", "no<|im_end|>")]
  rows = documents(directory)
  assert len(rows) == len(replies)
  for (tokens, codes), (chosen, rejected) in zip(rows, replies):
    assert len(tokens) == 159 and len(codes) == 160  # The loader's EOS makes the row.
    assert set(np.unique(codes)) <= {0, 1, 2}
    assert weighted_text(tokenizer_file, tokens, codes[:-1] == 1) == [chosen]
    with_eos = np.append(tokens, tokens[0])  # The row starts with the EOS.
    assert weighted_text(tokenizer_file, with_eos, codes == 2) == [rejected]
  # Earlier assistant turns of the prompt are context, never weighted.
  assert "hello<|im_end|>" not in weighted_text(tokenizer_file, *rows[2])


def test_bad_preference_input_is_one_line_naming_it(tmp_path, tokenizer_file):
  cases = {
      "nochosen": ({"prompt": "hi", "rejected": "no"}, r"needs \"chosen\" and \"rejected\""),
      "noprompt": ({"chosen": "a", "rejected": "b"}, r"needs \"prompt\" \(a string\) or "),
      "number": ({"prompt": "hi", "chosen": 3, "rejected": "b"},
                 r"'chosen' must be a string, as the prompt is; got int"),
      "list": ({"prompt": "hi", "chosen": "a", "rejected": [{"role": "assistant",
                                                             "content": "b"}]},
               r"'rejected' must be a string, as the prompt is; got list"),
      "two": ({"messages": [{"role": "user", "content": "hi"}], "chosen": "a",
               "rejected": [{"role": "assistant", "content": "b"}] * 2},
              r"'rejected' must be a string or a list of one assistant message"),
      "messages": ({"messages": "hi", "chosen": "a", "rejected": "b"},
                   r"'messages' must be a list of messages"),
  }
  for name, (record, message) in cases.items():
    with pytest.raises(UserError, match=rf"{name}\.jsonl:2: a preference record.*{message}"
                       ) as error:
      prepare_records(tmp_path, "preference", [PAIRS[0], record], tokenizer_file, name=name,
                      seq_len=64)
    assert "\n" not in str(error.value)
  with pytest.raises(UserError, match="a preference source needs --seq_len"):
    prepare_records(tmp_path, "preference", PAIRS, tokenizer_file, name="noseq")
  plain = make_tokenizer(tmp_path / "plain", template=None)
  with pytest.raises(UserError, match=r"plain_pairs\.jsonl:2: .* has none; pass --chat_template"):
    prepare_records(tmp_path, "preference", PAIRS[:2], plain, name="plain_pairs", seq_len=64)


def uppercase_pairs(count: int, seed: int) -> list[dict]:
  """The chosen reply says the prompt's word in upper case, the rejected in lower case."""
  rng = np.random.default_rng(seed)
  words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), rng.integers(3, 7)))
           for _ in range(count)]
  return [{"prompt": f"say {w}:", "chosen": f" {w.upper()}", "rejected": f" {w}"} for w in words]


@pytest.fixture(scope="module")
def byte_pairs(tmp_path_factory):
  directory = tmp_path_factory.mktemp("pairs")
  return prepare_records(directory, "preference", uppercase_pairs(400, 0), "byte", num_shards=2,
                         validation_fraction=0.1, seq_len=64)


def dpo_config(tiny_config, data):
  tiny_config.data.dataset = str(data)
  tiny_config.trainer.eval_tokens = 64 * 16
  return tiny_config


def held_at_the_reference_copy(monkeypatch) -> list[int]:
  """How many arrays of the token embedding's shape are alive when the run copies its params
  into the reference (step.copied, traced as the copy is about to run)."""
  held, copied = [], step.copied

  def counting(params):
    embedding = params["wte"]["embedding"]
    held.append(sum(a.shape == embedding.shape and a.dtype == embedding.dtype
                    for a in jax.live_arrays()))
    return copied(params)
  monkeypatch.setattr(step, "copied", counting)
  return held


@pytest.mark.slow
def test_a_dpo_run_learns_the_preference(tiny_config, byte_pairs, tmp_path, monkeypatch):
  held = held_at_the_reference_copy(monkeypatch)
  config = dpo_config(tiny_config, byte_pairs)
  config.trainer.batch_size, config.trainer.gradient_accumulation_steps = 16, 2
  config.trainer.num_train_steps, config.trainer.eval_every_steps = 15, 15
  config.checkpoint.every_steps = 15
  config.optimizer.learning_rate, config.optimizer.warmup_steps = 3e-3, 2
  config.dpo.beta = 0.5
  train_and_evaluate(to_run_config(config), tmp_path / "run")
  # At DPO's start the params are held once, beside AdamW's two moments, before the copy that
  # makes the reference: twice with it, never three times.
  assert held[-1] == 3
  logged = read_metrics(tmp_path / "run")
  trained = [m for m in logged if "train/loss" in m]
  assert trained[-1]["dpo/reward_accuracy"] > 0.9, trained[-1]
  # The policy starts as its reference: each pair's loss log 2, rewards 0.
  assert trained[0]["train/loss"] == pytest.approx(math.log(2), abs=1e-6)
  assert trained[0]["dpo/chosen_reward"] == pytest.approx(0, abs=1e-6)
  assert trained[-1]["train/loss"] < 0.5 * math.log(2)
  assert trained[-1]["dpo/chosen_reward"] > trained[-1]["dpo/rejected_reward"]
  evaluated = next(m for m in logged if "eval/loss" in m)
  assert evaluated["eval/dpo/reward_accuracy"] > 0.9 and evaluated["eval/loss"] < math.log(2)
  assert evaluated["eval/pairs"] == 16
  # The reference is saved once beside the checkpoints, which hold the policy alone.
  assert (tmp_path / "run" / "dpo_reference").is_dir()
  saved = ocp.StandardCheckpointer().restore(tmp_path / "run" / "checkpoints" / "15" / "state")
  assert saved.get("reference") is None and saved.get("frozen") is None
  # Resumed, the run compares with the reference it started from, not with where it resumed.
  config.trainer.num_train_steps = 16
  train_and_evaluate(to_run_config(config), tmp_path / "run")
  resumed = [m for m in read_metrics(tmp_path / "run") if "train/loss" in m][-1]
  assert resumed["step"] == 16 and resumed["dpo/margin"] > 1
  # On other data than preference pairs it would train by next-token loss: refused.
  config.data.dataset, config.data.restart_changed_datasets = "stdlib", True
  config.trainer.num_train_steps = 17
  with pytest.raises(UserError, match=r"trains by DPO, but its data is no longer preference"):
    train_and_evaluate(to_run_config(config), tmp_path / "run")


@pytest.mark.slow
def test_lora_dpo_takes_the_base_as_reference_without_a_copy(tiny_config, byte_pairs, tmp_path):
  config = dpo_config(tiny_config, byte_pairs)
  config.model.lora.rank = 4
  config.trainer.num_train_steps = config.trainer.eval_every_steps = 2
  run = to_run_config(config)
  partitioner = partitioning.Partitioner(partitioning.make_mesh(run.trainer.device_mesh),
                                         run.sharding)
  state = step.build(run, partitioner, EOS, dpo.Dpo()).abstract_state
  assert state.reference is None and state.frozen is not None
  assert jax.tree.structure(state.reference_params) == jax.tree.structure(state.frozen)
  train_and_evaluate(run, tmp_path / "run")
  # B is zero at init: the policy is its reference, the base, so the first loss is log 2.
  first = next(m for m in read_metrics(tmp_path / "run") if "train/loss" in m)
  assert first["train/loss"] == pytest.approx(math.log(2), abs=1e-6)
  assert first["dpo/margin"] == pytest.approx(0, abs=1e-6)
  assert (tmp_path / "run" / "lora_base").is_dir()
  assert not (tmp_path / "run" / "dpo_reference").exists()
  # Its checkpoints say it trains by DPO: on other data it is refused, LoRA or not.
  config.data.dataset, config.data.restart_changed_datasets = "stdlib", True
  config.trainer.num_train_steps = 3
  with pytest.raises(UserError, match=r"trains by DPO, but its data is no longer preference"):
    train_and_evaluate(to_run_config(config), tmp_path / "run")


@pytest.mark.slow
def test_a_run_refuses_preference_data_it_cannot_train_on(tiny_config, byte_pairs, tmp_path):
  config = dpo_config(tiny_config, byte_pairs)
  config.model.seq_len = 128
  with pytest.raises(UserError, match=r"rows of 64 tokens .* config.model.seq_len is 128"):
    train_and_evaluate(to_run_config(config), tmp_path / "long")
  config.model.seq_len, config.data.document_masking = 64, False
  with pytest.raises(UserError, match=r"config.data.document_masking must be True"):
    train_and_evaluate(to_run_config(config), tmp_path / "unmasked")
  config.data.document_masking, config.data.dataset = True, "stdlib"
  config.data.mixture.pairs = dict(dataset=str(byte_pairs), weight=0.5)
  config.data.mixture.text = dict(dataset="stdlib", weight=0.5)
  with pytest.raises(UserError, match=r"mixes preference data \(pairs\) with other data \(text\)"):
    train_and_evaluate(to_run_config(config), tmp_path / "mixed")
  # A run that trained by next-token loss does not turn to DPO when its data does.
  del config.data.mixture.pairs, config.data.mixture.text
  config.trainer.num_train_steps = config.trainer.eval_every_steps = 1
  train_and_evaluate(to_run_config(config), tmp_path / "next_token")
  config.data.dataset, config.data.restart_changed_datasets = str(byte_pairs), True
  config.trainer.num_train_steps = 2
  with pytest.raises(UserError, match=r"trains by next_token, and this start would train "
                                      r"by dpo"):
    train_and_evaluate(to_run_config(config), tmp_path / "next_token")


@pytest.mark.slow
def test_the_batch_search_compiles_the_step_with_its_reference_model(tiny_config):
  """batch_size=auto on preference data sizes the DPO step: a second copy of the params (the
  reference, replicated here as the params are) and its forward pass."""
  run = to_run_config(tiny_config)
  partitioner = partitioning.Partitioner(partitioning.make_mesh(run.trainer.device_mesh),
                                         run.sharding)
  params = jax.eval_shape(lambda: models.init_params(run.model, jax.random.key(0)))
  param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  plain = batch_search.step_bytes(run, partitioner, 2)
  assert batch_search.step_bytes(run, partitioner, 2,
                                 objective=dpo.Dpo()) >= plain + param_bytes


def test_checkpoints_record_the_objective_and_read_older_ones_dpo_flag():
  from levanter_flax.data.position import DataPosition
  from levanter_flax.training import restore
  saved = restore.Progress(DataPosition(3, {"a": 3}), objective="grpo").to_json()
  assert restore.Progress.from_json(saved).objective == "grpo"
  older = {k: v for k, v in saved.items() if k != "objective"}
  assert restore.Progress.from_json({**older, "dpo": True}).objective == "dpo"
  assert restore.Progress.from_json(older).objective == "next_token"
  with pytest.raises(ValueError, match="objective is not a name"):
    restore.Progress.from_json({**saved, "objective": 1})
