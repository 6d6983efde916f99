"""Hugging Face interop: checkpoints built locally with transformers (no download), both ways."""
import json
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from conftest import REPO, load_config_file
from levanter_flax import hf, models
from levanter_flax.checkpoint import run_params
from levanter_flax.config import to_run_config
from levanter_flax.errors import UserError
from levanter_flax.train import train_and_evaluate

HF_CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(vocab_size=61, n_positions=16, n_embd=32, n_layer=2,
                                            n_head=4),
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
        rope_theta=500.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
}
TOKENS = np.random.default_rng(0).integers(0, 61, (2, 16))


def hf_model(name: str, seed: int = 0):
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(HF_CONFIGS[name]())
  with torch.no_grad():  # Norm weights away from 1, so a misplaced norm cannot hide.
    for key, tensor in model.state_dict().items():
      if "norm" in key or "ln_" in key:
        tensor.add_(0.3 * torch.randn_like(tensor))
  return model.eval()


def hf_logits(model) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor(TOKENS)).logits.numpy()


@pytest.mark.parametrize("name", HF_CONFIGS)
def test_an_hf_checkpoint_loads_with_the_same_logits(name, tmp_path):
  model = hf_model(name)
  model.save_pretrained(tmp_path)
  cfg, params = hf.load(tmp_path)
  ours = np.asarray(models.build(cfg).apply({"params": params}, TOKENS))
  assert np.max(np.abs(ours - hf_logits(model))) <= 1e-4


@pytest.mark.parametrize("name", HF_CONFIGS)
def test_an_export_loads_in_transformers_with_the_same_logits(name, tmp_path):
  cfg, _ = hf.load(_saved(hf_model(name), tmp_path / "shape"))
  params = models.build(cfg).init(jax.random.key(3), TOKENS)["params"]
  params = jax.tree.map(lambda x: x + 0.1 * np.random.default_rng(4).normal(size=x.shape), params)
  hf.save(cfg, params, tmp_path / "export")
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
  ours = np.asarray(models.build(cfg).apply({"params": params}, TOKENS))
  assert np.max(np.abs(ours - hf_logits(exported))) <= 1e-4


def _saved(model, directory):
  model.save_pretrained(directory)
  return directory


def test_an_unsupported_architecture_is_named(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"]}))
  with pytest.raises(UserError, match=r"architecture 'BertForMaskedLM' is not supported; "
                                      r"supported: GPT2LMHeadModel, LlamaForCausalLM"):
    hf.load(tmp_path)


@pytest.mark.parametrize("damage, message", [
    ("drop", r"tensor model.layers.1.mlp.up_proj.weight is missing"),
    ("reshape", r"tensor model.layers.1.mlp.up_proj.weight has shape \(48, 16\), expected \(48, 32\)"),
])
def test_missing_or_misshapen_tensors_are_named(tmp_path, damage, message):
  directory = _saved(hf_model("llama"), tmp_path)
  [file] = directory.glob("*.safetensors")
  tensors = load_file(str(file))
  name = "model.layers.1.mlp.up_proj.weight"
  if damage == "drop":
    del tensors[name]
  else:
    tensors[name] = tensors[name][:, :16].copy()
  save_file(tensors, str(file), metadata={"format": "pt"})
  with pytest.raises(UserError, match=message):
    hf.load(directory)


@pytest.fixture
def tiny_llama(data_cache):
  config = load_config_file("llama_nano")
  config.model.seq_len, config.model.num_layers = 64, 2
  config.model.hidden_dim, config.model.intermediate_dim = 64, 128
  config.trainer.batch_size, config.trainer.num_train_steps = 8, 1
  config.trainer.eval_batches = 1
  config.data.cache_dir = str(data_cache)
  return config


def test_a_run_starts_from_an_hf_checkpoint_and_exports_back(tiny_llama, tmp_path):
  source = transformers.LlamaConfig(
      vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
      rms_norm_eps=1e-5, tie_word_embeddings=False)
  torch.manual_seed(0)
  transformers.LlamaForCausalLM(source).save_pretrained(tmp_path / "hf")
  tiny_llama.trainer.init_from_hf = str(tmp_path / "hf")
  tiny_llama.optimizer.learning_rate = 0.0  # The one step leaves the weights as loaded.
  train_and_evaluate(to_run_config(tiny_llama), tmp_path / "run")
  _, trained, _ = run_params(tmp_path / "run")
  _, loaded = hf.load(tmp_path / "hf")
  for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(loaded)):
    np.testing.assert_array_equal(np.asarray(a), b)

  result = subprocess.run([sys.executable, "-m", "levanter_flax.export_hf",
                           f"--workdir={tmp_path / 'run'}", f"--output_dir={tmp_path / 'out'}"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
  original = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
  assert np.max(np.abs(hf_logits(exported) - hf_logits(original))) <= 1e-4

  tiny_llama.model.num_layers = 3
  with pytest.raises(UserError, match=r"config.trainer.init_from_hf .* does not fit this model: "
                                      r"model.num_layers 2 \(checkpoint\) != 3 \(config\)"):
    train_and_evaluate(to_run_config(tiny_llama), tmp_path / "other")
