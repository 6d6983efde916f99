"""sample --chat: prompts rendered as transformers renders them, replies cut at the end of turn."""
import json
import os
import sys

import jax
import jax.numpy as jnp
import pytest

import forkserver
from conftest import REPO, xla_flags
from levanter_flax import models
from levanter_flax.generate.export import tokenizer_files
from levanter_flax.config import to_run_config
from levanter_flax.data.tokenizers import load_tokenizer
from levanter_flax.core.errors import UserError
from levanter_flax.generate.trained import chat_template
from levanter_flax.generate.engine import SamplingParams
from levanter_flax.generate.prompts import chat_prompts, encode, generate
from levanter_flax.training.loop import train_and_evaluate
from test_chat import CHATML, conversation, make_tokenizer, prepare_records
from test_sample import MODELS, PROMPTS

CHATS = [conversation(f"question {i} hello", f"answer {i} hello there, how are you")
         for i in range(40)]


@pytest.fixture(scope="module")
def chat_run_data(tmp_path_factory):
  """(tokenizer.json, a chat dataset prepared with its tokenizer_config.json's template)."""
  root = tmp_path_factory.mktemp("chat")
  tokenizer_file = make_tokenizer(root / "tokenizer")
  return tokenizer_file, prepare_records(root, "chat", CHATS, tokenizer_file,
                                         validation_fraction=0.3)


def saved_config(tokenizer_file, dataset) -> dict:
  """What chat_template reads of a run's config.json."""
  return {"data.tokenizer": tokenizer_file, "data.dataset": str(dataset)}


def test_a_chat_prompt_is_transformers_apply_chat_template(chat_run_data):
  transformers = pytest.importorskip("transformers")
  tokenizer_file, dataset = chat_run_data
  tokenizer = load_tokenizer(tokenizer_file)
  template = chat_template(saved_config(tokenizer_file, dataset), tokenizer, "")
  reference = transformers.PreTrainedTokenizerFast.from_pretrained(
      os.path.dirname(tokenizer_file))
  for system in ("", "be brief"):
    texts, stop_ids = chat_prompts(template, tokenizer, ["hello é ✓"], system)
    messages = [{"role": "system", "content": system}] * bool(system) + [
        {"role": "user", "content": "hello é ✓"}]
    expected = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
    assert encode(tokenizer, texts, bos=False) == [list(expected)]
    assert texts[0].endswith("<|im_start|>assistant\n")
  # Each prompt follows the EOS, as each conversation did in training.
  assert encode(tokenizer, texts, bos=True)[0][0] == tokenizer.eos_id
  vocab = reference.get_vocab()
  # The checkpoint's EOS (tokenizer_config.json's <|im_end|>), which is the end of turn too;
  # not the corpus separator <|endoftext|>, at which transformers' generate does not stop.
  assert stop_ids == (vocab["<|im_end|>"],) and tokenizer.eos_id == vocab["<|endoftext|>"]


@pytest.mark.slow
def test_a_reply_ends_before_its_first_stop_token():
  """Sampling on one seed draws the same tokens with or without stop tokens up to the first one;
  the reply ends there, that token left out; a row that never meets one runs to max_new_tokens."""
  cfg = MODELS["gpt2"]
  params = models.build(cfg).init(jax.random.key(1),
                                 jnp.zeros((1, cfg.seq_len), jnp.int32))["params"]
  unstopped = generate(cfg, params, PROMPTS, SamplingParams(max_tokens=12))
  stop = next(token for token in unstopped[0] if token != unstopped[0][0])  # Not the first.
  stopped = generate(cfg, params, PROMPTS, SamplingParams(max_tokens=12,
                                                         stop_ids=(stop, cfg.vocab_size + 1)))
  for full, cut in zip(unstopped, stopped):
    assert cut == (full[:full.index(stop)] if stop in full else full)
  assert 0 < len(stopped[0]) < 12
  # Every token a stop: empty replies, decoding cut short after the first look.
  everything = SamplingParams(max_tokens=17, temperature=1.0,
                             stop_ids=tuple(range(cfg.vocab_size)))
  assert generate(cfg, params, PROMPTS, everything) == [[], []]


def test_bad_chat_input_is_one_line(chat_run_data, tmp_path):
  tokenizer_file, dataset = chat_run_data
  tokenizer = load_tokenizer(tokenizer_file)

  def refused(saved, tokenizer, template_file="", match=""):
    with pytest.raises(UserError, match=match) as raised:
      chat_prompts(chat_template(saved, tokenizer, template_file), tokenizer, ["hi"], "")
    assert "\n" not in str(raised.value)

  plain = make_tokenizer(tmp_path / "plain", template=None)
  refused({"data.tokenizer": plain}, load_tokenizer(plain),
          match=r"has no chat template .* pass --chat_template=FILE \(a Jinja template\)$")
  refused({"data.tokenizer": "byte"}, load_tokenizer("byte"),
          match=r"^--chat needs a Hugging Face tokenizer.json .* data.tokenizer is 'byte' "
                r"\(byte\)$")
  strict = tmp_path / "strict.jinja"
  strict.write_text("{% if messages[0]['role'] != 'system' %}"
                    "{{ raise_exception('a system message comes first') }}{% endif %}" + CHATML)
  refused(saved_config(tokenizer_file, dataset), tokenizer, str(strict),
          match=r"^--prompt: the chat template \(.*strict.jinja\) refuses this conversation: "
                r"a system message comes first$")

  # The dataset's template edited since it was prepared: not the template the model learned.
  edited = tmp_path / "edited"
  edited.mkdir()
  moved = make_tokenizer(edited, template=CHATML.replace("\n", " "))
  changed = prepare_records(tmp_path, "chat", CHATS[:4], moved)
  config_file = edited / "tokenizer_config.json"
  config = json.loads(config_file.read_text())
  config_file.write_text(json.dumps(config | {"chat_template": CHATML}))
  refused(saved_config(moved, changed), load_tokenizer(moved),
          match=r"chat template .*tokenizer_config.json changed since .* was prepared with it")


@pytest.mark.slow
def test_the_command_line_chats_with_a_run(chat_run_data, tiny_config, tmp_path):
  tokenizer_file, dataset = chat_run_data
  tiny_config.data.tokenizer = tokenizer_file
  tiny_config.data.dataset = str(dataset)
  tiny_config.model.vocab_size = 320
  tiny_config.trainer.num_train_steps = 1
  tiny_config.trainer.eval_every_steps = 100
  train_and_evaluate(to_run_config(tiny_config), tmp_path)
  result = forkserver.run(
      [sys.executable, "-m", "levanter_flax.commands.sample", f"--workdir={tmp_path}", "--chat",
       "--system=be brief", "--prompt=hello", "--prompt=how are you", "--max_new_tokens=8",
       "--temperature=0"], cwd=REPO, capture_output=True, text=True, timeout=300,
      env={**os.environ, "XLA_FLAGS": xla_flags(1)})
  assert result.returncode == 0, result.stderr[-3000:]
  replies = result.stdout.split("--- ")[1:]
  assert [r.split("\n")[0] for r in replies] == ["'hello'", "'how are you'"]
  assert all("<|im_start|>" not in r and "<|im_end|>" not in r for r in replies)


def test_an_export_carries_the_template_its_chat_data_was_rendered_with(chat_run_data, tmp_path):
  """Prepared with --chat_template=FILE, not the tokenizer's own: the export's
  tokenizer_config.json holds that file's template, where AutoTokenizer reads it."""
  tokenizer_file, _ = chat_run_data
  template = tmp_path / "system_first.jinja"
  template.write_text("{{ '<|im_start|>system\nbe brief<|im_end|>\n' }}" + CHATML)
  dataset = prepare_records(tmp_path, "chat", CHATS[:4], tokenizer_file,
                            chat_template=str(template))
  files, _ = tokenizer_files(tmp_path, saved_config(tokenizer_file, dataset), 64)
  assert json.loads(files["tokenizer_config.json"])["chat_template"] == template.read_text()
