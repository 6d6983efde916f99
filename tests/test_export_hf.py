"""Exports that stand alone: dtype, shards, tokenizer and generation config, read by transformers
alone; imports of sharded, 16-bit, hub-cache checkpoints. Tiny models, no download."""
import hashlib
import json
import os
import shutil

import jax
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file

from conftest import load_config_file, prepare_texts, random_documents, write_dataset
from levanter_flax import models
from levanter_flax.generate.export import parse_size, tokenizer_files
from levanter_flax.hf import snapshot
from levanter_flax.generate.trained import run_params
from levanter_flax.config import to_run_config
from levanter_flax.data.tokenizers import train_bpe
from levanter_flax.core.errors import UserError
from levanter_flax.training.loop import train_and_evaluate
from test_hf import TOKENS, assert_one_error_line, export, hf_logits, hf_model


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory):
  """(workdir, tokenizer.json) of a one-step Llama run with bfloat16 parameters on data
  tokenized with a BPE of its own (no tokenizer_config.json beside it)."""
  root = tmp_path_factory.mktemp("bpe_run")
  tokenizer = root / "tokenizer" / "tokenizer.json"
  tokenizer.parent.mkdir()
  train_bpe(random_documents(60), 300, tokenizer)
  data = prepare_texts(root, random_documents(120), tokenizer=str(tokenizer))
  config = load_config_file("llama_nano")
  config.model.seq_len, config.model.num_layers = 32, 2
  config.model.hidden_dim, config.model.intermediate_dim = 32, 64
  config.model.compute.param_dtype = "bfloat16"
  config.trainer.batch_size, config.trainer.num_train_steps = 8, 1
  config.trainer.eval_tokens = 128
  config.data.dataset, config.data.tokenizer = str(data), str(tokenizer)
  train_and_evaluate(to_run_config(config), root / "run")
  return root / "run", tokenizer


def our_logits(workdir) -> np.ndarray:
  """Our model's float32 logits for TOKENS on the run's params (bfloat16 ones widened)."""
  cfg, params, _ = run_params(workdir)
  params = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
  return np.asarray(models.build(cfg).apply({"params": params}, TOKENS % cfg.vocab_size))


@pytest.mark.slow
def test_an_export_in_the_runs_bfloat16_loads_alone_in_transformers(bpe_run, tmp_path):
  workdir, tokenizer = bpe_run
  result = export(workdir, tmp_path / "out")
  assert result.returncode == 0, result.stderr[-3000:]
  out = tmp_path / "out"
  assert sorted(p.name for p in out.iterdir()) == [
      "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
      "tokenizer_config.json"]
  assert (out / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
  config = json.loads((out / "config.json").read_text())
  assert (config["dtype"], config["torch_dtype"]) == ("bfloat16", "bfloat16")
  assert (config["eos_token_id"], config["bos_token_id"]) == (0, 0)  # <|endoftext|>.
  assert json.loads((out / "generation_config.json").read_text()) == {
      "eos_token_id": 0, "bos_token_id": 0}

  assert transformers.AutoModelForCausalLM.from_pretrained(out).dtype == torch.bfloat16
  widened = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  cfg = snapshot.read_config(out)
  assert np.max(np.abs(hf_logits_of(widened, cfg.vocab_size) - our_logits(workdir))) <= 1e-4

  loaded = transformers.AutoTokenizer.from_pretrained(out)
  assert (loaded.eos_token, loaded.bos_token, loaded.model_max_length) == (
      "<|endoftext|>", "<|endoftext|>", 32)
  assert loaded("doc1-2: abc")["input_ids"] == hf_tokenizer_ids(tokenizer, "doc1-2: abc")
  generator = transformers.pipeline("text-generation", model=str(out), device="cpu")
  [generated] = generator("doc0-1: ab", max_new_tokens=4, do_sample=False)
  assert generated["generated_text"].startswith("doc0-1: ab")


def hf_logits_of(model, vocab_size: int) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor(TOKENS % vocab_size)).logits.numpy()


def hf_tokenizer_ids(path, text: str) -> list[int]:
  import tokenizers
  return tokenizers.Tokenizer.from_file(str(path)).encode(text).ids


@pytest.mark.slow
def test_a_sharded_float32_export_loads_with_the_same_logits(bpe_run, tmp_path):
  workdir, _ = bpe_run
  out = tmp_path / "out"
  result = export(workdir, out, "--dtype=float32", "--max_shard_size=40KB")
  assert result.returncode == 0, result.stderr[-3000:]
  shards = sorted(p.name for p in out.glob("*.safetensors"))
  assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
  index = json.loads((out / "model.safetensors.index.json").read_text())
  assert set(index["weight_map"].values()) == set(shards)
  assert index["metadata"]["total_size"] == sum(
      4 * int(np.prod(x.shape)) for x in jax.tree.leaves(run_params(workdir)[1]))
  for name in shards:  # Within the size, or a larger tensor alone (the embedding: 48 KiB).
    tensors = load_file(str(out / name))
    assert len(tensors) == 1 or sum(x.nbytes for x in tensors.values()) <= 40_000, name
  assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
  exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert exported.dtype == torch.float32
  ours = our_logits(workdir)
  assert np.max(np.abs(hf_logits_of(exported, ours.shape[-1]) - ours)) <= 1e-4
  assert snapshot.load(out)[0] == snapshot.read_config(out)  # And it imports back.

  # The same run again, unsharded: no shard of the sharded export stays beside it.
  result = export(workdir, out, "--overwrite")
  assert result.returncode == 0, result.stderr[-3000:]
  assert sorted(p.name for p in out.glob("*.safetensors*")) == ["model.safetensors"]


def hub_snapshot(source, cache) -> os.PathLike:
  """`source`'s files as the hub cache keeps them: blobs named by hash, and a snapshot of
  relative symlinks to them."""
  repo = cache / "models--org--tiny"
  directory = repo / "snapshots" / "0123abcd"
  (repo / "blobs").mkdir(parents=True)
  directory.mkdir(parents=True)
  for file in source.iterdir():
    blob = hashlib.sha256(file.read_bytes()).hexdigest()
    shutil.copy(file, repo / "blobs" / blob)
    (directory / file.name).symlink_to(f"../../blobs/{blob}")
  return directory


@pytest.mark.parametrize("dtype, shard_size", [(torch.bfloat16, "20KB"), (torch.float16, "5GB")])
def test_a_hub_cache_snapshot_imports_with_the_same_logits(tmp_path, dtype, shard_size):
  model = hf_model("llama")
  model.to(dtype).save_pretrained(tmp_path / "saved", max_shard_size=shard_size)
  cached = hub_snapshot(tmp_path / "saved", tmp_path / "hub")
  assert (shard_size == "20KB") == (cached / "model.safetensors.index.json").exists()
  cfg, params = snapshot.load(cached)
  widened = transformers.AutoModelForCausalLM.from_pretrained(cached, dtype=torch.float32)
  ours = np.asarray(models.build(cfg).apply({"params": params}, TOKENS))
  assert np.max(np.abs(ours - hf_logits(widened.eval()))) <= 1e-4


def test_an_index_naming_a_missing_shard_is_named(tmp_path):
  hf_model("llama").save_pretrained(tmp_path, max_shard_size="20KB")
  (tmp_path / "model-00003-of-00005.safetensors").unlink()
  with pytest.raises(UserError, match=r"model.safetensors.index.json names the file "
                                      r"'model-00003-of-00005.safetensors', which is not in"):
    snapshot.load(tmp_path)
  (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": 3}')
  with pytest.raises(UserError, match=r"cannot read .*index.json: expected an object with a "
                                      r"'weight_map'"):
    snapshot.load(tmp_path)


@pytest.mark.slow
def test_a_tokenizer_config_beside_the_tokenizer_is_copied(bpe_run, tmp_path):
  """Its chat template and special tokens go with the export; its EOS ends a generation too."""
  workdir, tokenizer = bpe_run
  (tmp_path / "tokenizer").mkdir()
  shutil.copy(tokenizer, tmp_path / "tokenizer" / "tokenizer.json")  # The same file, elsewhere.
  own = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "a",
         "pad_token": {"content": "<|endoftext|>"}, "chat_template": "{{ messages[0].content }}"}
  (tmp_path / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(own))
  saved = json.loads((workdir / "config.json").read_text())
  saved["data.tokenizer"] = str(tmp_path / "tokenizer" / "tokenizer.json")
  files, ids = tokenizer_files(workdir, saved, 32)
  assert json.loads(files["tokenizer_config.json"]) == own
  a = hf_tokenizer_ids(tokenizer, "a")[0]
  assert ids == {"eos_token_id": [0, a], "bos_token_id": None, "pad_token_id": 0}


def test_a_byte_tokenizer_run_exports_without_tokenizer_files(tmp_path, caplog):
  data = write_dataset(tmp_path / "data", ["some text"], ["more text"])
  saved = {"data.tokenizer": "byte", "data.dataset": str(data), "data.mixture": []}
  assert tokenizer_files(tmp_path, saved, 32) == ({}, {"eos_token_id": 256})
  assert ("The run's byte tokenizer (data.tokenizer=byte) is no tokenizer.json: no tokenizer "
          "files written") in caplog.text


@pytest.mark.parametrize("flag, message", [
    ("--dtype=int8", "flag --dtype=int8: value should be one of <bfloat16|float16|float32>"),
    ("--max_shard_size=5TB", "--max_shard_size='5TB' is not a size: give a positive int of bytes"),
])
def test_a_bad_flag_is_one_line_naming_it(tmp_path, flag, message):
  assert_one_error_line(export(tmp_path / "run", tmp_path / "out", flag), message)


@pytest.mark.parametrize("text, size", [("5GB", 5 * 10**9), ("500MB", 5 * 10**8), ("2GiB", 2**31),
                                        ("1kib", 1024), ("5Gb", 625_000_000), ("1234", 1234)])
def test_shard_sizes_read_as_transformers_reads_them(text, size):
  assert parse_size(text, "--max_shard_size") == size
  from transformers.utils.hub import convert_file_size_to_int
  assert convert_file_size_to_int(int(text) if text.isdigit() else text) == size
