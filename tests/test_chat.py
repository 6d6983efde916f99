"""Chat and instruction data: prepare's chat and prompt_completion sources, and the masked loss."""
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import prepare_texts, random_documents, read_metrics
from levanter_flax.objectives import next_token
from levanter_flax.training import step
from levanter_flax.config import to_run_config
from levanter_flax.data import loader, dataset_writer, sources, tfrecord
from levanter_flax.data.manifest import PreparedDataset, load_manifest
from levanter_flax.data.position import DataPosition
from levanter_flax.data.tokenizers import load_tokenizer
from levanter_flax.core.errors import UserError
from levanter_flax.models.gpt2 import GPT2Config, GPT2LMHeadModel
from levanter_flax.training.loop import train_and_evaluate

# Qwen2's ChatML template, shortened: a system turn, then each turn between <|im_start|>ROLE\n and
# <|im_end|>\n; roles it does not know are refused with raise_exception.
CHATML = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# The same, its replies marked for transformers' assistant mask: each reply and its <|im_end|>,
# not the newline after it.
CHATML_MARKED = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

WEIGHTED = next_token.NextToken(weighted=True)


def make_tokenizer(directory: pathlib.Path, template: str | None = CHATML,
                   eos_token: str = "<|im_end|>") -> str:
  """A small byte-level BPE with ChatML's special tokens, and its tokenizer_config.json."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers
  directory.mkdir(parents=True, exist_ok=True)
  tokenizer = tokenizers.Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tokenizer.train_from_iterator(random_documents(50) + ["hello there, how are you"] * 20,
                                trainer=trainer)
  tokenizer.save(str(directory / "tokenizer.json"))
  config = {"eos_token": eos_token, "pad_token": "<|endoftext|>",
            "tokenizer_class": "PreTrainedTokenizerFast"}
  if template is not None:
    config["chat_template"] = template
  (directory / "tokenizer_config.json").write_text(json.dumps(config))
  return str(directory / "tokenizer.json")


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> str:
  return make_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def conversation(*turns, system=None) -> dict:
  roles = ["user", "assistant"] * len(turns)
  messages = [{"role": "system", "content": system}] if system else []
  return {"messages": messages + [{"role": r, "content": t} for r, t in zip(roles, turns)]}


def write_jsonl(path: pathlib.Path, records: list) -> pathlib.Path:
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return path


def prepare_records(tmp_path, kind, records, tokenizer_file, name="data", **options):
  inputs = write_jsonl(tmp_path / f"{name}.jsonl", records)
  options = {"num_shards": 1, "validation_fraction": 0.0} | options
  return dataset_writer.prepare_dataset(dataset_writer.PrepareOptions(
      source=sources.SourceSpec(kind=kind, inputs=(str(inputs),)), output_dir=tmp_path / name,
      tokenizer=tokenizer_file, **options))


def documents(directory: pathlib.Path, split="train") -> list[tuple[np.ndarray, np.ndarray]]:
  """(tokens, weights: the tokens' and the EOS's) of each document, in shard order."""
  manifest = load_manifest(directory)
  found = []
  for shard in manifest["splits"][split]:
    path = str(directory / shard["file"])
    found += zip(tfrecord.read_shard(path, manifest["token_dtype"]),
                 tfrecord.read_loss_weights(path))
  return found


def weighted_text(tokenizer_file, tokens, weights) -> list[str]:
  """The weighted runs of a document, each decoded with its special tokens."""
  tokenizer = load_tokenizer(tokenizer_file)._tokenizer  # pylint: disable=protected-access
  runs, run = [], []
  for token, weight in zip(tokens, weights):
    if weight:
      run.append(int(token))
    elif run:
      runs, run = runs + [run], []
  runs += [run] if run else []
  return [tokenizer.decode(r, skip_special_tokens=False) for r in runs]


MULTI_TURN = conversation("hello", "hello there, how are you", "and you?", "fine é ✓",
                          system="be brief")


def test_the_weighted_tokens_are_each_assistant_turn_and_its_end_of_turn(tmp_path, tokenizer_file):
  directory = prepare_records(tmp_path, "chat", [MULTI_TURN, conversation("hi", "")],
                              tokenizer_file)
  (multi, multi_weights), (empty, empty_weights) = documents(directory)
  assert weighted_text(tokenizer_file, multi, multi_weights) == [
      "hello there, how are you<|im_end|>", "fine é ✓<|im_end|>"]
  # An empty assistant turn still teaches its end of turn; the EOS the loader appends never
  # weighs: the conversation's last turn has ended.
  assert weighted_text(tokenizer_file, empty, empty_weights) == ["<|im_end|>"]
  assert len(multi_weights) == len(multi) + 1 and multi_weights[-1] == 0
  manifest = load_manifest(directory)
  assert manifest["format_version"] == 3
  assert manifest["splits"]["train"][0]["num_loss_tokens"] == multi_weights.sum() + 1
  # The tokens are those of the whole conversation tokenized at once, as at inference.
  tokenizer = load_tokenizer(tokenizer_file)
  rendered = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
                     for m in MULTI_TURN["messages"])
  np.testing.assert_array_equal(multi, tokenizer.encode(rendered))


def test_rendering_is_transformers_apply_chat_template(tmp_path, tokenizer_file):
  transformers = pytest.importorskip("transformers")
  from levanter_flax.data import chat
  template = chat.load_template(tokenizer_file, "")
  reference = transformers.PreTrainedTokenizerFast(
      tokenizer_file=tokenizer_file, chat_template=CHATML, eos_token="<|im_end|>")
  for add_generation_prompt in (False, True):
    assert template.render(MULTI_TURN["messages"], add_generation_prompt, "test") == (
        reference.apply_chat_template(MULTI_TURN["messages"], tokenize=False,
                                      add_generation_prompt=add_generation_prompt))


@pytest.mark.parametrize("eos_token", ["<|im_end|>", "<|endoftext|>"])
def test_the_weights_are_transformers_assistant_mask_at_the_edges(tmp_path, eos_token):
  """Replies that quote <|im_end|>, and a base tokenizer (eos_token <|endoftext|>, not the
  template's <|im_end|>): the weights are transformers' assistant mask of the marked template,
  with or without its marks, and sample --chat stops at the token that ends each reply."""
  transformers = pytest.importorskip("transformers")
  from levanter_flax.data import chat
  from levanter_flax.generate.prompts import chat_prompts
  tokenizer_file = make_tokenizer(tmp_path / "tokenizer", CHATML_MARKED, eos_token)
  records = [conversation("quote it", "it is <|im_end|>, then more", "and?", "<|im_end|>x"),
             MULTI_TURN]
  reference = transformers.PreTrainedTokenizerFast(
      tokenizer_file=tokenizer_file, chat_template=CHATML_MARKED, eos_token=eos_token)
  unmarked = tmp_path / "chatml.jinja"
  unmarked.write_text(CHATML)
  for name, template_file in (("marked", ""), ("unmarked", str(unmarked))):
    directory = prepare_records(tmp_path, "chat", records, tokenizer_file, name=name,
                                chat_template=template_file)
    for record, (tokens, weights) in zip(records, documents(directory)):
      expected = reference.apply_chat_template(record["messages"], tokenize=True,
                                               return_dict=True,
                                               return_assistant_tokens_mask=True)
      np.testing.assert_array_equal(tokens, expected["input_ids"])
      np.testing.assert_array_equal(weights[:-1], expected["assistant_masks"])
    tokenizer = load_tokenizer(tokenizer_file)
    template = chat.load_template(tokenizer_file, template_file)
    _, stop_ids = chat_prompts(template, tokenizer, ["hi"], "")
    # The checkpoint's EOS (tokenizer_config.json's) and the end of turn.
    assert stop_ids == tuple(sorted({int(tokenizer.encode(eos_token)[0]),
                                     int(tokenizer.encode("<|im_end|>")[0])}))


def test_prompt_completion_weighs_the_completion_and_its_eos(tmp_path, tokenizer_file):
  directory = prepare_records(tmp_path, "prompt_completion",
                              [{"prompt": "Q: hello? A:", "completion": " hello there"},
                               {"prompt": "Q: nothing? A:", "completion": ""}], tokenizer_file)
  (tokens, weights), (_, empty_weights) = documents(directory)
  assert weighted_text(tokenizer_file, tokens, weights[:-1]) == [" hello there"]
  assert weights[-1] == 1 and empty_weights.sum() == 1 and empty_weights[-1] == 1


def test_bad_chat_input_is_one_line_naming_it(tmp_path, tokenizer_file, caplog):
  records = [conversation("hi"), {"messages": [{"role": "user", "content": "hi"}]}, MULTI_TURN]
  directory = prepare_records(tmp_path, "chat", records, tokenizer_file)
  assert load_manifest(directory)["source"]["conversations_without_assistant_skipped"] == 2
  assert "skipped 2 conversations without an assistant turn (" in caplog.text

  tool = {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"},
                       {"role": "assistant", "content": "42"}]}
  with pytest.raises(UserError, match=r"tool\.jsonl:2: the chat template .* refuses this "
                                      r"conversation: Unknown role: tool"):
    prepare_records(tmp_path, "chat", [MULTI_TURN, tool], tokenizer_file, name="tool")
  # Fixed in place, the same command runs in the directory the failure left.
  directory = prepare_records(tmp_path, "chat", [MULTI_TURN, MULTI_TURN], tokenizer_file,
                              name="tool")
  assert len(documents(directory)) == 2

  plain = make_tokenizer(tmp_path / "plain", template=None)
  with pytest.raises(UserError, match="has no chat template .* pass --chat_template=FILE"):
    prepare_records(tmp_path, "chat", [MULTI_TURN], plain, name="plain")
  assert not (tmp_path / "plain_data").exists()
  template = tmp_path / "chatml.jinja"
  template.write_text(CHATML)
  directory = prepare_records(tmp_path, "chat", [MULTI_TURN], plain, name="given",
                              chat_template=str(template))
  assert load_manifest(directory)["chat_template"]["file"] == str(template)

  with pytest.raises(UserError, match=r"notes\.jsonl:1: a chat record needs \"messages\""):
    prepare_records(tmp_path, "chat", [{"text": "hi"}], tokenizer_file, name="notes")


def test_skipped_conversations_are_named_by_file_and_line(tmp_path, tokenizer_file, caplog):
  """Three shards each read every third line: the warning names the first five of all of them,
  whichever shard read them, and counts the rest; the manifest keeps both."""
  without = {2, 3, 5, 8, 9, 11, 12}
  records = [{"messages": [{"role": "user", "content": "hi"}]} if line in without
             else MULTI_TURN for line in range(1, 13)]
  directory = prepare_records(tmp_path, "chat", records, tokenizer_file, num_shards=3)
  file = tmp_path / "data.jsonl"
  first = [f"{file}:{line}" for line in (2, 3, 5, 8, 9)]
  assert (f"skipped 7 conversations without an assistant turn ({', '.join(first)} and 2 more)"
          in caplog.text)
  source = load_manifest(directory)["source"]
  assert source["conversations_without_assistant_skipped"] == 7
  assert source["conversations_without_assistant_first"] == first
  with pytest.raises(UserError, match=rf"holds no non-empty documents \(0 empty ones skipped, 1 "
                                      rf"conversations without an assistant turn \(.*none\.jsonl:1\)\)"):
    prepare_records(tmp_path, "chat", records[1:2], tokenizer_file, name="none")


SEQ_LEN = 16


def test_windows_carry_their_tokens_weights_across_conversations(tmp_path, tokenizer_file):
  """A conversation longer than a window is cut as pretraining text is, each window with its
  tokens' weights; a mixture with pretraining data gives that data weights of 1."""
  long = conversation(*[f"turn {i} hello there, how are you" for i in range(8)])
  chats = prepare_records(tmp_path, "chat", [long, MULTI_TURN, conversation("hi", "")] * 3,
                          tokenizer_file)
  stream = [(t, w) for tokens, weights in documents(chats)
            for t, w in zip(np.append(tokens, load_tokenizer(tokenizer_file).eos_id), weights)]
  assert len(stream) > 4 * SEQ_LEN
  usable = len(stream) // SEQ_LEN * SEQ_LEN
  as_bytes = lambda window: np.asarray(window, np.int64).tobytes()
  expected = sorted(map(as_bytes, np.array(stream[:usable]).reshape(-1, SEQ_LEN, 2)))
  chat_source = PreparedDataset("chat", chats, load_manifest(chats), 1.0)
  dataset = loader.train_dataset([chat_source], seq_len=SEQ_LEN, local_batch_size=1, seed=0,
                                 position=DataPosition(0, {"chat": 0}))
  read = list(dataset.take(len(expected)).as_numpy_iterator())
  got = sorted(as_bytes(np.stack([b["tokens"][0], b["loss_weights"][0]], -1)) for b in read)
  assert got == expected

  text = prepare_texts(tmp_path / "text", random_documents(20), tokenizer=tokenizer_file)
  mixture = [chat_source, PreparedDataset("text", text, load_manifest(text), 1.0)]
  assert loader.has_loss_weights(mixture)
  dataset = loader.train_dataset(mixture, seq_len=SEQ_LEN, local_batch_size=4, seed=0,
                                 position=DataPosition(0, {}))
  for batch in dataset.take(8).as_numpy_iterator():
    assert (batch["loss_weights"][batch["source"] == 1] == 1).all()
    assert batch["loss_weights"].dtype == np.uint8


TINY = GPT2Config(vocab_size=64, seq_len=16, num_layers=2, num_heads=2, hidden_dim=32)
EOS = 63


def reference_loss(logits, tokens, weights) -> float:
  """The weighted next-token cross-entropy in NumPy (float64)."""
  logits = np.asarray(logits, np.float64)[:, :-1]
  log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  labels = np.take_along_axis(logits, np.asarray(tokens)[:, 1:, None], -1)[..., 0]
  w = np.asarray(weights, np.float64)[:, 1:]
  return float(((log_z - labels) * w).sum() / w.sum())


def reference_logit_gradient(logits, tokens, weights) -> np.ndarray:
  """d reference_loss / d logits in NumPy: w * (softmax - one_hot) / sum(w)."""
  logits = np.asarray(logits, np.float64)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  one_hot = np.eye(logits.shape[-1])[np.asarray(tokens)[:, 1:]]
  w = np.asarray(weights, np.float64)[:, 1:]
  grad = np.zeros_like(logits)
  grad[:, :-1] = (probs[:, :-1] - one_hot) * w[..., None] / w.sum()
  return grad


@pytest.mark.slow
@pytest.mark.parametrize("num_microbatches", [1, 2, 4])
@pytest.mark.parametrize("eos_id", [None, EOS])
def test_the_masked_loss_and_gradient_are_numpys(num_microbatches, eos_id):
  """The weight falls unevenly on the microbatches (rows 0, 4: none; rows 1, 5: all), so a
  mean of microbatch means would differ from the batch's weighted mean."""
  model = GPT2LMHeadModel(TINY)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, EOS, (8, TINY.seq_len)).astype(np.int32)
  tokens[:, [5, 11]] = EOS  # Three documents a row.
  weights = (rng.random(tokens.shape) < 0.3).astype(np.float32)
  weights[[0, 4]] = 0
  weights[[1, 5]] = 1
  params = model.init(jax.random.key(0), jnp.asarray(tokens))["params"]
  segments = None if eos_id is None else step.segment_ids(jnp.asarray(tokens), eos_id)
  logits, pullback = jax.vjp(lambda p: model.apply({"params": p}, jnp.asarray(tokens),
                                                   segment_ids=segments), params)
  expected_grads = pullback(jnp.asarray(reference_logit_gradient(logits, tokens, weights),
                                        jnp.float32))[0]
  parts, grads = jax.jit(lambda p, t, w: step.accumulated_loss_and_grads(
      model, p, {"tokens": t, "loss_weights": w}, num_microbatches, eos_id, WEIGHTED))(
          params, tokens, weights)
  assert float(parts["loss"]) == pytest.approx(reference_loss(logits, tokens, weights), rel=1e-5)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)
  sums, counts = step.make_eval_step(model, eos_id)(params, {"tokens": tokens,
                                                             "loss_weights": weights})
  assert float(sums.sum() / counts.sum()) == pytest.approx(float(parts["loss"]), rel=1e-5)


@pytest.mark.slow
def test_all_weights_one_is_the_unweighted_loss():
  model = GPT2LMHeadModel(TINY)
  tokens = jax.random.randint(jax.random.key(1), (8, TINY.seq_len), 0, TINY.vocab_size)
  params = model.init(jax.random.key(0), tokens)["params"]
  plain, _ = step.accumulated_loss_and_grads(model, params, {"tokens": tokens}, 2)
  ones, _ = step.accumulated_loss_and_grads(
      model, params, {"tokens": tokens, "loss_weights": jnp.ones(tokens.shape, jnp.float32)}, 2,
      objective=WEIGHTED)
  assert float(ones["loss"]) == pytest.approx(float(plain["loss"]), rel=1e-6)


@pytest.mark.slow
def test_a_run_trains_and_evaluates_on_chat_mixed_with_text(tmp_path, tokenizer_file,
                                                            tiny_config):
  chats = [conversation(f"question {i} hello", f"answer {i} hello there, how are you")
           for i in range(60)]
  chat_dir = prepare_records(tmp_path, "chat", chats, tokenizer_file, num_shards=2,
                             validation_fraction=0.3)
  text_dir = prepare_texts(tmp_path / "text", random_documents(40), tokenizer=tokenizer_file,
                           num_shards=2)
  tiny_config.data.tokenizer = tokenizer_file
  tiny_config.data.mixture.chat = dict(dataset=str(chat_dir), weight=0.5)
  tiny_config.data.mixture.text = dict(dataset=str(text_dir), weight=0.5)
  tiny_config.model.vocab_size = 320
  tiny_config.trainer.num_train_steps = 4
  tiny_config.trainer.eval_every_steps = 4
  tiny_config.trainer.batch_size = 16
  tiny_config.trainer.gradient_accumulation_steps = 2
  tiny_config.data.document_masking = True
  train_and_evaluate(to_run_config(tiny_config), tmp_path / "run")
  logged = read_metrics(tmp_path / "run")
  trained = [m for m in logged if "train/loss" in m]
  assert all(0 < m["train/loss_tokens"] < 16 * 63 for m in trained)
  evaluated = next(m for m in logged if "eval/chat/loss" in m)
  assert np.isfinite(evaluated["eval/chat/loss"]) and "eval/chat/bits_per_byte" not in evaluated
  assert "eval/text/bits_per_byte" in evaluated
  # The chat eval scores the weighted tokens only: each conversation's answer and end of turn.
  assert evaluated["eval/chat/tokens"] < evaluated["eval/text/tokens"]


@pytest.mark.slow
def test_abstract_inputs_carry_the_weights_the_train_step_takes(tiny_config):
  from levanter_flax.parallel import partitioning
  run = to_run_config(tiny_config)
  partitioner = partitioning.Partitioner(partitioning.make_mesh(run.trainer.device_mesh),
                                         run.sharding)
  steps = step.build(run, partitioner, objective=WEIGHTED)
  with partitioner.activation_context():
    state, batch = steps.abstract_inputs(8)
    assert batch["loss_weights"].shape == batch["tokens"].shape
    compiled = steps.train_step.lower(state, batch).compile()
    state = steps.init(jax.random.key(0))
    tokens = jnp.zeros((8, run.model.seq_len), jnp.int32)
    weights = jnp.zeros(tokens.shape, jnp.float32).at[:, -3:].set(1)
    batch = {"tokens": jax.device_put(tokens, steps.batch_sharding),
             "loss_weights": jax.device_put(weights, steps.batch_sharding)}
    _, metrics = compiled(state, batch)
  assert float(metrics["train/loss_tokens"]) == 8 * 3
