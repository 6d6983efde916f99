"""Tokenizers round-trip text, are recorded in the manifest, and a mismatched config is refused."""
import json
import shutil

import pytest

from conftest import prepare_texts, random_documents
from levanter_flax.generate import trained
from levanter_flax.config import default_config, to_run_config
from levanter_flax.data import loader, tfrecord, tokenizers
from levanter_flax.data.manifest import load_manifest
from levanter_flax.data.tokenizers import ByteTokenizer, load_tokenizer, train_bpe
from levanter_flax.core.errors import UserError

TEXT = "def f(x):\n    return 'héllo ✓'  # naïve\n"


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
  train_bpe(random_documents(50) + [TEXT] * 5, 400, path)
  return path


@pytest.fixture(scope="module")
def sentencepiece_file(tmp_path_factory):
  import sentencepiece
  directory = tmp_path_factory.mktemp("spm")
  (directory / "corpus.txt").write_text("\n".join(random_documents(50) + [TEXT] * 5))
  sentencepiece.SentencePieceTrainer.train(
      input=str(directory / "corpus.txt"), model_prefix=str(directory / "spm"), vocab_size=400,
      character_coverage=1.0, byte_fallback=True, minloglevel=2)
  return directory / "spm.model"


def test_byte_tokenizer_round_trip():
  tokenizer = ByteTokenizer()
  assert tokenizer.decode(tokenizer.encode(TEXT)) == TEXT


def test_trained_bpe_round_trips_and_has_eos(bpe_file):
  tokenizer = load_tokenizer(str(bpe_file))
  assert tokenizer.vocab_size == 400
  assert tokenizer.eos_id == 0  # The one special token comes first.
  ids = tokenizer.encode(TEXT)
  assert len(ids) < 0.8 * len(TEXT.encode())  # It learned merges.
  assert tokenizer.decode(ids) == TEXT


def test_sentencepiece_round_trips(sentencepiece_file):
  tokenizer = load_tokenizer(str(sentencepiece_file))
  assert tokenizer.vocab_size == 400
  assert tokenizer.eos_id == 2
  assert tokenizer.decode(tokenizer.encode("plain words here")) == "plain words here"


@pytest.mark.parametrize("kind", ["bpe", "sentencepiece"])
def test_dataset_is_tokenized_with_the_file_and_records_it(tmp_path, request, kind):
  path = request.getfixturevalue({"bpe": "bpe_file", "sentencepiece": "sentencepiece_file"}[kind])
  texts = random_documents(20)
  directory = prepare_texts(tmp_path, texts, tokenizer=str(path), validation_fraction=0.0)
  manifest = load_manifest(directory)
  tokenizer = load_tokenizer(str(path))
  assert manifest["tokenizer"]["vocab_size"] == tokenizer.vocab_size
  assert manifest["tokenizer"]["sha256"] == tokenizer.sha256
  decoded = [tokenizer.decode(tokens) for shard in manifest["splits"]["train"]
             for tokens in tfrecord.read_shard(str(directory / shard["file"]), "uint16")]
  # SentencePiece normalizes whitespace, so its round trip is to its own normal form.
  assert sorted(decoded) == sorted(tokenizer.decode(tokenizer.encode(t)) for t in texts)
  if kind == "bpe":
    assert sorted(decoded) == sorted(texts)


def test_config_with_another_tokenizer_is_refused(tmp_path, bpe_file):
  directory = prepare_texts(tmp_path, random_documents(20))
  config = default_config()
  config.data.dataset = str(directory)
  config.data.tokenizer = str(bpe_file)
  with pytest.raises(UserError, match=f"dataset {directory} was tokenized with byte \\(vocab 257\\), "
                     f"but config.data.tokenizer '{bpe_file}' is huggingface sha256:"):
    loader.load_datasets(to_run_config(config).data)
  config.data.tokenizer = str(tmp_path / "missing.json")
  with pytest.raises(UserError, match="is neither 'byte' nor an existing tokenizer.json"):
    loader.load_datasets(to_run_config(config).data)


def test_sample_refuses_a_tokenizer_file_changed_since_the_run(tmp_path, bpe_file):
  tokenizer = tmp_path / "tokenizer.json"
  shutil.copy(bpe_file, tokenizer)
  directory = prepare_texts(tmp_path, random_documents(20), tokenizer=str(tokenizer))
  saved = {"data.dataset": str(directory), "data.mixture": [], "data.tokenizer": str(tokenizer)}
  trained_with = load_tokenizer(str(bpe_file))
  assert trained.run_tokenizer(tmp_path, saved).sha256 == trained_with.sha256
  train_bpe(random_documents(50, seed=1), 400, tokenizer)  # Retrained in place: other merges.
  with pytest.raises(UserError, match=(
      f"tokenizer {tokenizer} is huggingface sha256:\\w{{12}} \\(vocab 400\\), but the run in "
      f"{tmp_path} trained on {directory}, tokenized with huggingface "
      f"sha256:{trained_with.sha256[:12]} \\(vocab 400\\): the file changed since")):
    trained.run_tokenizer(tmp_path, saved)


@pytest.mark.parametrize("content", ["not json", '{"version": "1.0"}'])
def test_a_broken_tokenizer_json_is_named(tmp_path, content):
  path = tmp_path / "tokenizer.json"
  path.write_text(content)
  with pytest.raises(UserError) as error:
    load_tokenizer(str(path))
  assert str(error.value).startswith(
      f"cannot load tokenizer {path}: not a Hugging Face tokenizer.json (")
  assert "\n" not in str(error.value)


def bare_bpe(directory, special=("<|endoftext|>", "<|im_start|>", "<|im_end|>")) -> str:
  """A byte-level BPE whose first ids are `special`, with no file beside it."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers
  directory.mkdir(parents=True, exist_ok=True)
  tokenizer = tokenizers.Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.train_from_iterator(random_documents(20), trainer=trainers.BpeTrainer(
      vocab_size=300, special_tokens=list(special), show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tokenizer.save(str(directory / "tokenizer.json"))
  return str(directory / "tokenizer.json")


@pytest.mark.parametrize("files, stop_ids", [
    ({}, (0,)),  # A bare tokenizer.json: the first name it has of EOS_CANDIDATES.
    ({"tokenizer_config.json": {"eos_token": "<|im_end|>"}}, (2,)),
    ({"tokenizer_config.json": {"eos_token": "<|im_end|>"}, "config.json": {"eos_token_id": 1}},
     (1,)),
    # Qwen2.5-Instruct's: generation_config.json's list, before config.json's one id.
    ({"generation_config.json": {"eos_token_id": [2, 0]}, "config.json": {"eos_token_id": 0},
      "tokenizer_config.json": {"eos_token": "<|endoftext|>"}}, (2, 0)),
    ({"generation_config.json": {"eos_token_id": 2}}, (2,)),
])
def test_generation_stops_at_the_checkpoint_eos_ids(tmp_path, files, stop_ids):
  path = bare_bpe(tmp_path)
  for name, contents in files.items():
    (tmp_path / name).write_text(json.dumps(contents))
  tokenizer = load_tokenizer(path)
  assert tokenizer.stop_ids == stop_ids
  assert tokenizer.eos_id == 0  # The corpus separator stays one id, the name found first.


def test_an_eos_named_only_by_the_checkpoint_ends_documents(tmp_path):
  """DeepSeek-V3's EOS has none of the usual names."""
  path = bare_bpe(tmp_path, ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"))
  with pytest.raises(UserError, match="has none of the end-of-document tokens .* and no "
                                      "tokenizer_config.json, generation_config.json or "
                                      "config.json beside it names its EOS"):
    load_tokenizer(path)
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
      {"eos_token": {"content": "<｜end▁of▁sentence｜>", "special": True}}))
  tokenizer = load_tokenizer(path)
  assert (tokenizer.eos_id, tokenizer.stop_ids, tokenizer.eos_text) == (
      1, (1,), "<｜end▁of▁sentence｜>")


@pytest.mark.parametrize("value", ["2", [], [2, 9999], True])
def test_a_bad_eos_token_id_is_one_line(tmp_path, value):
  path = bare_bpe(tmp_path)
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": value}))
  tokenizer = load_tokenizer(path)  # Preparing and training read no stop ids.
  with pytest.raises(UserError, match=f"{tmp_path / 'generation_config.json'}: eos_token_id "
                                      f".* must be a token id or a list of them, each in "
                                      f"\\[0, 300\\)"):
    tokenizer.stop_ids


def test_a_model_trained_here_also_stops_at_the_eos_that_ended_its_documents(tmp_path):
  """A checkpoint's <|im_end|> alone ends its own generations, as transformers' do; a run that
  trained on documents ended by <|endoftext|> ends there too."""
  path = bare_bpe(tmp_path)
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
  checkpoint = load_tokenizer(path)
  trained_here = tokenizers.ending_documents(checkpoint)
  assert (checkpoint.stop_ids, trained_here.stop_ids) == ((2,), (2, 0))
  assert load_tokenizer(path).stop_ids == (2,)  # The cached one is left as it is.
  assert tokenizers.ending_documents(load_tokenizer("byte")).stop_ids == (256,)


def test_a_tokenizer_rewritten_in_place_is_read_anew(tmp_path):
  path = bare_bpe(tmp_path)
  assert load_tokenizer(path).stop_ids == (0,)
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2]}))
  assert load_tokenizer(path).stop_ids == (2,)
  before = load_tokenizer(path).sha256
  bare_bpe(tmp_path, ("<|endoftext|>", "<|im_end|>"))
  assert load_tokenizer(path).sha256 != before
