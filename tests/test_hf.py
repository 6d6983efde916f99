"""Hugging Face interop: checkpoints built locally with transformers (no download), both ways."""
import dataclasses
import json
import re
import stat
import sys

import jax
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

import forkserver
from conftest import REPO, load_config_file, train_losses
from levanter_flax.hf import snapshot
from levanter_flax import models
from levanter_flax.generate.trained import run_params
from levanter_flax.config import to_run_config
from levanter_flax.core.errors import UserError
from levanter_flax.models.llama import rope_attention_factor, rope_frequencies
from levanter_flax.training.loop import train_and_evaluate
from levanter_flax.models import common
from levanter_flax.models.common import with_compute

def _llama(**changes):
  return transformers.LlamaConfig(**{
      "vocab_size": 61, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 16,
      "rope_theta": 500.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, **changes})


def _qwen2(**changes):
  return transformers.Qwen2Config(**{
      "vocab_size": 61, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 16,
      "rope_theta": 500.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, **changes})


def _qwen3(**changes):  # Heads of 12 on a width of 32: head_dim is not hidden_size / heads.
  return transformers.Qwen3Config(**{
      "vocab_size": 61, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12,
      "max_position_embeddings": 16, "rope_theta": 500.0, "rms_norm_eps": 1e-6,
      "tie_word_embeddings": False, **changes})


def _olmo2(**changes):
  return transformers.Olmo2Config(**{
      "vocab_size": 61, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 16,
      "rope_theta": 500.0, "rms_norm_eps": 1e-6, **changes})


def _gemma3(**changes):
  """Local, global, local: a window of 4 of the 16 tokens, RoPE bases of their own; heads of 12
  on a width of 32, scores scaled by 16 ** -0.5 (not 12's), grouped key/value heads."""
  return transformers.Gemma3TextConfig(**{
      "vocab_size": 61, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12,
      "max_position_embeddings": 16, "rms_norm_eps": 1e-6, "sliding_window": 4,
      "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
      "query_pre_attn_scalar": 16,
      "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
                          "full_attention": {"rope_type": "default", "rope_theta": 500.0}},
      **changes})


def _mistral(**changes):
  return transformers.MistralConfig(**{
      "vocab_size": 61, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 16,
      "rope_theta": 500.0, "rms_norm_eps": 1e-5, **changes})


def _mixtral(**changes):
  return transformers.MixtralConfig(**{
      "vocab_size": 61, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 16,
      "rope_theta": 500.0, "rms_norm_eps": 1e-5, "num_local_experts": 4,
      "num_experts_per_tok": 2, **changes})


def _qwen3_moe(**changes):  # Qwen3's heads of 12, and experts narrower than the width.
  return transformers.Qwen3MoeConfig(**{
      "vocab_size": 61, "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 24,
      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12,
      "max_position_embeddings": 16, "rope_theta": 500.0, "rms_norm_eps": 1e-6,
      "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True, **changes})


def _deepseek_v3(**changes):
  """A dense layer, then two of 8 experts in 4 groups (2 per token from 2 groups) beside a
  shared one; queries through a bottleneck, interleaved RoPE, heads whose keys (8 + 4) and
  values (6) differ in width."""
  return transformers.DeepseekV3Config(**{
      "vocab_size": 61, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 24,
      "num_hidden_layers": 3, "first_k_dense_replace": 1, "num_attention_heads": 4,
      "num_key_value_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 12, "qk_nope_head_dim": 8,
      "qk_rope_head_dim": 4, "v_head_dim": 6, "n_routed_experts": 8, "num_experts_per_tok": 2,
      "n_group": 4, "topk_group": 2, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
      "max_position_embeddings": 16, "rope_theta": 500.0, "num_nextn_predict_layers": 0,
      **changes})


# Head dim 8, theta 500: wavelengths 6.3, 30, 140 and 660 positions. With an original context
# of 64, llama3 keeps the first (< 64/4), ramps the second and divides the last two (> 64/1).
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64, "rope_theta": 500.0}
# An original context of 8 of the 16 tokens, so that YaRN's interpolation matters.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
        "rope_theta": 500.0}
HF_CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(vocab_size=61, n_positions=16, n_embd=32, n_layer=2,
                                            n_head=4),
    "gpt2_untied": lambda: transformers.GPT2Config(vocab_size=61, n_positions=16, n_embd=32,
                                                   n_layer=2, n_head=4, tie_word_embeddings=False),
    "llama": _llama,
    "llama_rope_linear": lambda: _llama(
        rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 500.0}),
    "llama_rope_llama3": lambda: _llama(rope_parameters=dict(LLAMA3)),
    "llama_rope_yarn": lambda: _llama(rope_parameters=dict(YARN)),
    "llama_tied": lambda: _llama(tie_word_embeddings=True),
    "qwen2": lambda: _qwen2(),
    "qwen2_tied": lambda: _qwen2(tie_word_embeddings=True),
    "qwen3": lambda: _qwen3(),
    "qwen3_tied": lambda: _qwen3(tie_word_embeddings=True),
    "olmo2": _olmo2,
    "gemma3": _gemma3,
    # Layer kinds no pattern gives (global first): kept letter by letter.
    "gemma3_irregular": lambda: _gemma3(
        layer_types=["full_attention", "sliding_attention", "sliding_attention"]),
    # transformers' default pattern (every 2nd layer global here), an untied head, the final
    # soft-cap, and linear RoPE scaling on the global layers (Gemma 3 4B's).
    "gemma3_untied_softcap_linear": lambda: _gemma3(
        layer_types=None, sliding_window_pattern=2, num_hidden_layers=4, tie_word_embeddings=False,
        final_logit_softcapping=2.0, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 500.0}}),
    "mistral": lambda: _mistral(sliding_window=4),  # Shorter than the 16 tokens: it matters.
    "mistral_no_window": lambda: _mistral(sliding_window=None),
    "mixtral": _mixtral,
    "mixtral_top1_of_3": lambda: _mixtral(num_local_experts=3, num_experts_per_tok=1),
    "qwen3_moe": _qwen3_moe,
    # transformers' default: the chosen experts' probabilities as they are.
    "qwen3_moe_unnormalized_top3_of_6": lambda: _qwen3_moe(num_experts=6, num_experts_per_tok=3,
                                                           norm_topk_prob=False),
    "deepseek_v3": _deepseek_v3,
    # DeepSeek-V2-Lite's plain q_proj, no dense layer, one group, RoPE on halves, unnormalised.
    "deepseek_v3_plain": lambda: _deepseek_v3(
        q_lora_rank=None, first_k_dense_replace=0, n_group=1, topk_group=1, rope_interleave=False,
        norm_topk_prob=False, n_shared_experts=2),
    # DeepSeek-V3's YaRN: mscale and mscale_all_dim, which scale its scores too.
    "deepseek_v3_yarn": lambda: _deepseek_v3(rope_parameters={
        **YARN, "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 16, "beta_slow": 2}),
}
TOKENS = np.random.default_rng(0).integers(0, 61, (2, 16))
# Every config unrolled, and each family's plain one scanned: the layers stack the same way
# whatever the variant (a tied head, RoPE scaling or a window change no tensor in the stack).
LAYOUTS = [(name, False) for name in HF_CONFIGS] + [(name, True) for name in models.FAMILIES]


def hf_model(name: str, seed: int = 0):
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(HF_CONFIGS[name]())
  with torch.no_grad():  # Norm weights away from 1, so a misplaced norm cannot hide.
    for key, tensor in model.state_dict().items():
      if "norm" in key or "ln_" in key:
        tensor.add_(0.3 * torch.randn_like(tensor))
      if any(p in key for p in ("q_proj", "k_proj", "q_b_proj", "kv_a_proj")):
        tensor.mul_(6.0)  # Peaked attention, so positions (RoPE) matter.
      if key.endswith("mlp.gate.weight"):  # Decisive routing: a wrong expert would show.
        tensor.mul_(20.0)
      if key.endswith((".bias", "e_score_correction_bias")):  # Zero: a dropped one would not show.
        tensor.add_(0.3 * torch.randn_like(tensor))
  return model.eval()


def hf_logits(model) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor(TOKENS)).logits.numpy()


# transformers' model_type -> our family, where the two differ.
FAMILY_OF_MODEL_TYPE = {"gemma3_text": "gemma3"}


def our_config(name: str, scan_layers: bool = False):
  """Our model config for HF_CONFIGS[name]."""
  config = HF_CONFIGS[name]()
  family = FAMILY_OF_MODEL_TYPE.get(config.model_type, config.model_type)
  cfg = models.FAMILIES[family].hf.config_from_hf(config.to_dict())
  return with_compute(cfg, scan_layers=scan_layers)


@pytest.mark.parametrize("name, scan_layers", LAYOUTS)
def test_an_hf_checkpoint_loads_with_the_same_logits(name, scan_layers, tmp_path):
  model = hf_model(name)
  model.save_pretrained(tmp_path)
  cfg, params = snapshot.load(tmp_path, scan_layers)
  assert cfg == our_config(name, scan_layers)
  ours = np.asarray(models.build(cfg).apply({"params": params}, TOKENS))
  assert np.max(np.abs(ours - hf_logits(model))) <= 1e-4


@pytest.mark.parametrize("name, scan_layers", LAYOUTS)
def test_an_export_loads_in_transformers_with_the_same_logits(name, scan_layers, tmp_path):
  cfg = our_config(name, scan_layers)
  params = models.build(cfg).init(jax.random.key(3), TOKENS)["params"]
  params = jax.tree.map(lambda x: x + 0.1 * np.random.default_rng(4).normal(size=x.shape), params)
  snapshot.save(cfg, params, tmp_path / "export")
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
  ours = np.asarray(models.build(cfg).apply({"params": params}, TOKENS))
  assert np.max(np.abs(ours - hf_logits(exported))) <= 1e-4


@pytest.mark.parametrize("name", models.FAMILIES)
def test_a_scanned_export_is_the_unrolled_one_tensor_for_tensor(name, tmp_path):
  for scan_layers in (False, True):  # The same weights either way (see models.init_params).
    cfg = our_config(name, scan_layers)
    snapshot.save(cfg, models.init_params(cfg, jax.random.key(0)), tmp_path / str(scan_layers))
  unrolled, scanned = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("False", "True"))
  assert scanned.keys() == unrolled.keys()
  for key, value in unrolled.items():
    np.testing.assert_array_equal(scanned[key], value, err_msg=key)
  assert (tmp_path / "True" / "config.json").read_text() == (
      tmp_path / "False" / "config.json").read_text()


def _saved(model, directory):
  model.save_pretrained(directory)
  return directory


def test_mistrals_sliding_window_matters_and_none_means_none(tmp_path):
  model = hf_model("mistral")
  cfg, params = snapshot.load(_saved(model, tmp_path / "window"))
  assert cfg.sliding_window == 4
  unwindowed = models.build(dataclasses.replace(cfg, sliding_window=0))
  assert np.max(np.abs(np.asarray(unwindowed.apply({"params": params}, TOKENS))
                       - hf_logits(model))) > 1e-2
  assert snapshot.load(_saved(hf_model("mistral_no_window"), tmp_path / "none"))[0].sliding_window == 0


def test_a_qwen3_config_without_head_dim_reads_as_transformers_reads_it(tmp_path):
  """Qwen3Config's head_dim defaults to 128 whatever the width, not hidden_size / heads."""
  config = json.loads(HF_CONFIGS["qwen3"]().to_json_string())
  del config["head_dim"]
  (tmp_path / "config.json").write_text(json.dumps(config | {"architectures": ["Qwen3ForCausalLM"]}))
  assert snapshot.read_config(tmp_path).head_dim == 128
  assert transformers.AutoConfig.from_pretrained(tmp_path).head_dim == 128


@pytest.mark.parametrize("change", ["window", "kinds", "local_rope", "scale"])
def test_gemma3s_window_layer_kinds_rope_bases_and_score_scale_matter(change, tmp_path):
  """Each is read from the checkpoint and changes the logits: none is a no-op at this size."""
  model = hf_model("gemma3")
  cfg, params = snapshot.load(_saved(model, tmp_path))
  assert (cfg.sliding_window, cfg.global_layers, cfg.rope_local_theta, cfg.rope_theta,
          cfg.query_pre_attn_scalar) == (4, (False, True, False), 50.0, 500.0, 16)
  # layer_types local, global, local is every 2nd layer global: read as that pattern, so a run
  # config that says sliding_window_pattern=2 agrees with the checkpoint.
  assert (cfg.sliding_window_pattern, cfg.layer_types) == (2, "")
  changed = dataclasses.replace(cfg, **{
      "window": {"sliding_window": 16}, "kinds": {"layer_types": "GLG"},
      "local_rope": {"rope_local_theta": 500.0}, "scale": {"query_pre_attn_scalar": 12}}[change])
  assert np.max(np.abs(np.asarray(models.build(changed).apply({"params": params}, TOKENS))
                       - hf_logits(model))) > 1e-3


@pytest.mark.parametrize("change", ["groups", "bias", "scaling", "interleave"])
def test_deepseeks_groups_bias_scaling_and_rope_layout_matter(change, tmp_path):
  """Each is read from the checkpoint and changes the logits: none is a no-op at this size."""
  model = hf_model("deepseek_v3")
  cfg, params = snapshot.load(_saved(model, tmp_path))
  if change == "bias":
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: 0 * x if path[-1].key == "e_score_correction_bias" else x, params)
  else:
    cfg = dataclasses.replace(cfg, rope_interleave=False) if change == "interleave" else (
        dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, **{
            "groups": {"top_groups": 4}, "scaling": {"routed_scaling_factor": 1.0}}[change])))
  assert np.max(np.abs(np.asarray(models.build(cfg).apply({"params": params}, TOKENS))
                       - hf_logits(model))) > 1e-3


def test_a_gemma3_config_of_transformers_4_reads_as_transformers_5_reads_it(tmp_path):
  """Gemma 3 1B's config.json as published (transformers 4.50): the RoPE bases as rope_theta and
  rope_local_base_freq, the layers as sliding_window_pattern, no rope_parameters or layer_types."""
  published = {
      "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 61,
      "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
      "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 12,
      "max_position_embeddings": 16, "rms_norm_eps": 1e-6, "sliding_window": 4,
      "sliding_window_pattern": 2, "rope_theta": 500.0, "rope_local_base_freq": 50.0,
      "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "query_pre_attn_scalar": 16,
      "final_logit_softcapping": None, "attn_logit_softcapping": None,
      "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False}
  (tmp_path / "config.json").write_text(json.dumps(published))
  ours = snapshot.read_config(tmp_path)
  theirs = transformers.AutoConfig.from_pretrained(tmp_path)
  assert ours.global_layers == tuple(t == "full_attention" for t in theirs.layer_types) == (
      False, True, False)
  assert (ours.rope_theta, ours.rope_type, ours.rope_factor) == (
      theirs.rope_parameters["full_attention"]["rope_theta"], "linear", 8.0)
  assert ours.rope_local_theta == theirs.rope_parameters["sliding_attention"]["rope_theta"] == 50.0
  assert ours.head_dim == 12 and ours.tie_word_embeddings
  assert (ours.sliding_window_pattern, ours.layer_types) == (2, "")


@pytest.mark.parametrize("name", ["llama_rope_linear", "llama_rope_llama3", "llama_rope_yarn"])
def test_rope_scaling_matters_and_loads_from_either_key(name, tmp_path):
  model = hf_model(name)
  directory = _saved(model, tmp_path)
  cfg, params = snapshot.load(directory)
  unscaled = models.build(dataclasses.replace(cfg, rope_type="default"))
  assert np.max(np.abs(np.asarray(unscaled.apply({"params": params}, TOKENS))
                       - hf_logits(model))) > 1e-2  # The scaling is not a no-op at this size.
  # transformers 4.x wrote rope_scaling, with "type" in older files, and rope_theta beside it.
  config = json.loads((directory / "config.json").read_text())
  rope = config.pop("rope_parameters")
  config["rope_theta"] = rope.pop("rope_theta")
  rope["type"] = rope.pop("rope_type")
  (directory / "config.json").write_text(json.dumps({**config, "rope_scaling": rope}))
  assert snapshot.load(directory)[0] == cfg


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 8.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},  # Llama 3.1's.
    {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},  # Llama 3.2's.
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},  # Qwen3's.
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},  # DeepSeek-V3's.
])
def test_rope_frequencies_are_transformers_own_at_full_size(rope, tmp_path):
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
  config = transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32,
                                    max_position_embeddings=131072,
                                    rope_parameters={**rope, "rope_theta": 500000.0})
  theirs, attention_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")
  config.architectures = ["LlamaForCausalLM"]
  config.save_pretrained(tmp_path)
  ours = snapshot.read_config(tmp_path)
  np.testing.assert_allclose(rope_frequencies(ours), theirs.numpy(), rtol=1e-6)
  assert rope_attention_factor(ours) == pytest.approx(attention_factor, rel=1e-7)


@pytest.mark.parametrize("name, changes, message", [
    ("llama", {"rope_parameters": {"rope_type": "longrope", "factor": 4.0, "rope_theta": 500.0}},
     r": rope_parameters.rope_type='longrope' is not supported \(only default, "
     r"linear, llama3, yarn\)"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 5.0}},
     r"lacks 'original_max_position_embeddings' for LlamaForCausalLM"),
    ("llama", {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
     r": rope_scaling.type='dynamic' is not supported"),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5.0}},
     r"lacks 'rope_parameters.low_freq_factor' for LlamaForCausalLM"),
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": "4", "rope_theta": 5.0}},
     r"rope_parameters.factor must be a positive number, got '4'"),
    ("llama", {"partial_rotary_factor": 0.5},
     r": partial_rotary_factor=0.5 is not supported"),
    # Read for every family of Llama's kind: the message names no family.
    ("qwen2", {"rope_parameters": {"rope_type": "longrope", "factor": 4.0, "rope_theta": 5.0}},
     r": rope_parameters.rope_type='longrope' is not supported"),
    ("llama", {"hidden_act": "gelu"}, r"Llama config hidden_act='gelu' is not supported"),
    ("llama", {"attention_bias": True}, r"Llama config attention_bias=True is not supported"),
    ("llama", {"tie_word_embeddings": "yes"}, r"tie_word_embeddings must be true or false"),
    ("qwen2", {"use_sliding_window": True},
     r"Qwen2 config use_sliding_window=True is not supported \(only False\)"),
    ("qwen3", {"use_sliding_window": True},
     r"Qwen3 config use_sliding_window=True is not supported \(only False\)"),
    ("qwen3", {"layer_types": ["full_attention", "sliding_attention"]},
     r"Qwen3 config layer_types=\['full_attention', 'sliding_attention'\] is not supported"),
    ("qwen3", {"attention_bias": True}, r"Qwen3 config attention_bias=True is not supported"),
    ("qwen3_moe", {"mlp_only_layers": [1]},
     r"Qwen3-MoE config mlp_only_layers=\[1\] is not supported \(only \[\]\)"),
    ("qwen3_moe", {"decoder_sparse_step": 2},
     r"Qwen3-MoE config decoder_sparse_step=2 is not supported \(only 1\)"),
    ("qwen3_moe", {"use_sliding_window": True}, r"Qwen3-MoE config use_sliding_window=True"),
    ("qwen3_moe", {"norm_topk_prob": "yes"}, r"norm_topk_prob must be true or false, got 'yes'"),
    ("deepseek_v3", {"num_nextn_predict_layers": 1},
     r"DeepSeek-V3 config num_nextn_predict_layers=1 is not supported \(only 0\)"),
    ("deepseek_v3", {"n_group": 3}, r"DeepSeek-V3 config n_group=3 must divide n_routed_experts=8"),
    ("deepseek_v3", {"topk_method": "greedy"}, r"DeepSeek-V3 config topk_method='greedy'"),
    ("deepseek_v3", {"topk_group": 5}, r"config.model.moe.top_groups must be between 1 and "
                                       r"config.model.moe.num_groups \(4\); got 5"),
    ("olmo2", {"attention_bias": True}, r"OLMo 2 config attention_bias=True is not supported"),
    ("olmo2", {"head_dim": 12}, r"head_dim 12 x 4 heads != hidden_size 32: not supported"),
    ("gemma3", {"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
     r"Gemma 3 config layer_types\[1\]='chunked_attention' is not supported \(only "
     r"'sliding_attention' and 'full_attention'\)"),
    ("gemma3", {"layer_types": ["full_attention"]},
     r"Gemma 3 config layer_types must be a list of num_hidden_layers \(3\) layer kinds"),
    ("gemma3", {"attn_logit_softcapping": 50.0},
     r"Gemma 3 config attn_logit_softcapping=50.0 is not supported \(only None\)"),
    ("gemma3", {"use_bidirectional_attention": True},
     r"Gemma 3 config use_bidirectional_attention=True is not supported"),
    ("gemma3", {"hidden_activation": "gelu"},
     r"Gemma 3 config hidden_activation='gelu' is not supported \(only 'gelu_pytorch_tanh'\)"),
    ("gemma3", {"attention_bias": True}, r"Gemma 3 config attention_bias=True is not supported"),
    ("gemma3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     r"Gemma 3 config rope_parameters.full_attention.rope_type='yarn' is not supported \(only "
     r"default, linear\)"),
    ("gemma3", {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0,
                                                          "rope_theta": 50.0}}},
     r"Gemma 3 config rope_parameters.sliding_attention.rope_type='linear' is not supported "
     r"\(only default\)"),
    ("gemma3", {"sliding_window": None},
     r"config.model.sliding_window must be positive: Gemma 3's local layers"),
    ("llama", {"num_hidden_layers": 2.5}, r"num_hidden_layers must be a positive integer, got 2.5"),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True},
     r"GPT-2 config scale_attn_by_inverse_layer_idx=True is not supported \(only False\)"),
    ("gpt2", {"scale_attn_weights": False}, r"GPT-2 config scale_attn_weights=False"),
    ("gpt2", {"n_inner": 100}, r"GPT-2 config n_inner=100 is not supported \(only 4 x n_embd, 128"),
    ("gpt2", {"add_cross_attention": True}, r"GPT-2 config add_cross_attention=True"),
    ("gpt2", {"n_layer": "two"}, r"n_layer must be a positive integer, got 'two'"),
    ("gpt2", {"layer_norm_epsilon": [1e-5]}, r"layer_norm_epsilon must be a positive number"),
    ("gpt2", {"tie_word_embeddings": "no"}, r"tie_word_embeddings must be true or false, got 'no'"),
])
def test_configs_we_cannot_represent_are_refused_by_key(tmp_path, name, changes, message):
  config = json.loads(HF_CONFIGS[name]().to_json_string())
  config["architectures"] = [models.FAMILIES[name].hf.architecture]
  (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))
  with pytest.raises(UserError, match=re.escape(str(tmp_path / "config.json")) + ".*" + message):
    snapshot.load(tmp_path)


def test_bfloat16_tensors_load_and_integer_ones_are_refused(tmp_path):
  model = hf_model("llama")
  model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
  cfg, params = snapshot.load(tmp_path / "bf16")
  widened = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16",
                                                               dtype=torch.float32).eval()
  ours = np.asarray(models.build(cfg).apply({"params": params}, TOKENS))
  assert np.max(np.abs(ours - hf_logits(widened))) <= 1e-4

  directory = _saved(hf_model("llama"), tmp_path / "int8")
  [file] = directory.glob("*.safetensors")
  tensors = load_file(str(file))
  tensors["model.layers.1.mlp.up_proj.weight"] = np.ones((48, 32), np.int8)
  save_file(tensors, str(file), metadata={"format": "pt"})
  with pytest.raises(UserError, match=r"tensor model.layers.1.mlp.up_proj.weight has dtype I8; "
                                      r"only floating point \(F16, BF16, F32, F64\)"):
    snapshot.load(directory)


@pytest.mark.parametrize("damage, message", [
    ("truncate", r"model.safetensors is truncated or not a safetensors file: Error while "
                 r"deserializing header: incomplete metadata"),
    ("garbage", r"model.safetensors is truncated or not a safetensors file: Error while "
                r"deserializing header"),
    ("empty", r"model.safetensors is truncated or not a safetensors file: Error while "
              r"deserializing header: header too small"),
    ("not_json", r"model.safetensors is truncated or not a safetensors file: Error while "
                 r"deserializing header"),
])
def test_a_damaged_safetensors_file_is_named(tmp_path, damage, message):
  directory = _saved(hf_model("gpt2"), tmp_path)
  file = directory / "model.safetensors"
  data = file.read_bytes()
  file.write_bytes({"truncate": data[:len(data) // 2], "garbage": b"<html>Not Found</html>" * 3,
                    "empty": b"", "not_json": (5).to_bytes(8, "little") + b"\xff\xfe{[x"}[damage])
  with pytest.raises(UserError, match=message):
    snapshot.load(directory)


def test_an_unsupported_architecture_is_named(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"]}))
  with pytest.raises(UserError, match=r"architecture 'BertForMaskedLM' is not supported; "
                                      r"supported: GPT2LMHeadModel, LlamaForCausalLM"):
    snapshot.load(tmp_path)


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("damage, message", [
    ("drop", r"tensor model.layers.1.mlp.up_proj.weight is missing"),
    ("reshape", r"tensor model.layers.1.mlp.up_proj.weight has shape \(48, 16\), expected \(48, 32\)"),
])
def test_missing_or_misshapen_tensors_are_named(tmp_path, damage, message, scan_layers):
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
    snapshot.load(directory, scan_layers)


@pytest.fixture
def tiny_llama(data_cache):
  """llama:nano, short and quick; with trainer.init_from_hf, its checkpoint's shape."""
  config = load_config_file("llama_nano")
  config.model.seq_len = 64
  config.trainer.batch_size, config.trainer.num_train_steps = 8, 1
  config.trainer.eval_tokens = 512
  config.data.cache_dir = str(data_cache)
  return config


@pytest.mark.slow
@pytest.mark.parametrize("scan_layers", [False, True])
def test_a_run_starts_from_an_hf_checkpoint_and_exports_back(tiny_llama, scan_layers, tmp_path):
  # Every shape key other than llama:nano's, and no flag restating one: config.json decides.
  source = transformers.LlamaConfig(
      vocab_size=320, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
      num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=64,
      rope_theta=500.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
  torch.manual_seed(0)
  transformers.LlamaForCausalLM(source).save_pretrained(tmp_path / "hf")
  tiny_llama.trainer.init_from_hf = str(tmp_path / "hf")
  tiny_llama.model.compute.scan_layers = scan_layers
  # One step this small (0 is refused) leaves float32 weights exactly as loaded.
  tiny_llama.optimizer.learning_rate = 1e-30
  tiny_llama.trainer.log_every_steps = 1
  train_and_evaluate(to_run_config(tiny_llama), tmp_path / "run")
  # The resume reads the same config.json, so it agrees with the run's saved config.
  tiny_llama.trainer.num_train_steps = 2
  train_and_evaluate(to_run_config(tiny_llama), tmp_path / "run")
  assert sorted(train_losses(tmp_path / "run")) == [1, 2]
  _, trained, _ = run_params(tmp_path / "run")
  _, loaded = snapshot.load(tmp_path / "hf", scan_layers)
  assert jax.tree.structure(trained) == jax.tree.structure(loaded)
  for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(loaded)):
    np.testing.assert_array_equal(np.asarray(a), b)

  result = export(tmp_path / "run", tmp_path / "out")
  assert result.returncode == 0, result.stderr[-3000:]
  for name in ("model.safetensors", "config.json"):  # Readable by others, not 0600.
    assert stat.S_IMODE((tmp_path / "out" / name).stat().st_mode) == 0o644, name
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
  original = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
  assert np.max(np.abs(hf_logits(exported) - hf_logits(original))) <= 1e-4
  if scan_layers:
    return  # What follows is the command's, whatever the layout.
  assert_one_error_line(export(tmp_path / "run", tmp_path / "out"),
                        f"--output_dir {tmp_path / 'out'} is not empty; pass --overwrite")
  # A sharded checkpoint was there before: none of its files may survive next to ours.
  stale = ["model-00001-of-00002.safetensors", "model.safetensors.index.json"]
  for name in stale:
    (tmp_path / "out" / name).write_text("stale")
  result = export(tmp_path / "run", tmp_path / "out", "--overwrite")
  assert result.returncode == 0, result.stderr[-3000:]
  assert not any((tmp_path / "out" / name).exists() for name in stale)
  assert snapshot.load(tmp_path / "out")[0] == snapshot.read_config(tmp_path / "hf")


@pytest.mark.parametrize("name, config_file, seq_len", [
    ("llama_tied", "llama_nano", 128),  # RoPE: the run's context, not max_position_embeddings.
    ("gpt2_untied", "gpt2_nano", 16)])  # The position table's rows: a shape, config.json's.
def test_init_from_hf_takes_the_model_from_config_json_before_anything_is_built(
    name, config_file, seq_len, tmp_path, monkeypatch):
  directory = _saved(hf_model(name), tmp_path / "hf")
  for builder in ("build", "init_params"):
    monkeypatch.setattr(models, builder, lambda *a, **k: pytest.fail("a model was built"))
  config = load_config_file(config_file)
  config.trainer.init_from_hf = str(directory)
  config.model.compute.scan_layers = True
  model = to_run_config(config).model
  assert model == dataclasses.replace(our_config(name, scan_layers=True), seq_len=seq_len)
  # A flag that agrees with config.json is no conflict; one that does not is one line.
  config.model.num_layers, config.model.vocab_size = 2, 7
  assert to_run_config(config, {"model.num_layers", "model.compute.scan_layers"}).model == model
  with pytest.raises(UserError) as refused:
    to_run_config(config, {"model.num_layers", "model.vocab_size"})
  assert str(refused.value) == (
      f"--config.model.vocab_size=7 disagrees with {directory / 'config.json'} "
      f"(config.trainer.init_from_hf), which has 61: drop the flag; the checkpoint decides "
      f"config.model.vocab_size")
  other = load_config_file("qwen2_nano")
  other.trainer.init_from_hf = str(directory)
  with pytest.raises(UserError, match=rf"^{re.escape(str(directory / 'config.json'))} \(config"
                                      rf".trainer.init_from_hf\) holds a {model.architecture} model, but "
                                      rf"config.model.architecture is 'qwen2': start from a "):
    to_run_config(other)


def test_a_contradicted_flag_stops_the_command_in_one_line_before_its_workdir(tmp_path):
  directory = _saved(hf_model("llama"), tmp_path / "hf")
  result = forkserver.run(
      [sys.executable, "-m", "levanter_flax.main", "--config=llama_nano",
       f"--workdir={tmp_path / 'run'}", f"--config.trainer.init_from_hf={directory}",
       "--config.model.seq_len=8", "--config.model.num_kv_heads=4"],
      cwd=REPO, capture_output=True, text=True, timeout=300)
  assert_one_error_line(result, f"--config.model.num_kv_heads=4 disagrees with "
                                f"{directory / 'config.json'} (config.trainer.init_from_hf), "
                                f"which has 2")
  assert not (tmp_path / "run").exists()


def export(workdir, output_dir, *flags):
  return forkserver.run([sys.executable, "-m", "levanter_flax.commands.export_hf",
                         f"--workdir={workdir}",
                         f"--output_dir={output_dir}", *flags],
                        cwd=REPO, capture_output=True, text=True, timeout=300)


def assert_one_error_line(result, message):
  assert result.returncode == 1, result.stderr[-3000:]
  assert "Traceback" not in result.stderr, result.stderr[-3000:]
  errors = [line for line in result.stderr.splitlines() if line.startswith("levanter_flax: error:")]
  assert len(errors) == 1 and message in errors[0], result.stderr[-3000:]


@pytest.mark.parametrize("output, message", [
    ("run", "--output_dir {run} is inside the training run's --workdir {run}"),
    ("run/hf", "--output_dir {run}/hf is inside the training run's --workdir {run}"),
    ("other_run", "--output_dir {other_run} holds a training run (config.json and checkpoints/)"),
])
def test_export_never_writes_into_a_training_run(tmp_path, output, message):
  for run in ("run", "other_run"):
    (tmp_path / run / "checkpoints").mkdir(parents=True)
    (tmp_path / run / "config.json").write_text("{}")
  paths = {"run": tmp_path / "run", "other_run": tmp_path / "other_run"}
  result = export(paths["run"], tmp_path / output, "--overwrite")
  assert_one_error_line(result, message.format(**paths))
  assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoints", "config.json"]


def test_a_checkpoint_loads_where_auto_attention_is_splash(tmp_path, monkeypatch):
  """On a TPU host 'auto' is splash, which refuses sequences shorter than its blocks: the
  shapes a load checks against are traced with XLA's attention, as models.init_params is."""
  model = hf_model("llama")
  model.save_pretrained(tmp_path)
  monkeypatch.setattr(common, "platform_in_context", lambda: "tpu")
  cfg, params = snapshot.load(tmp_path)
  monkeypatch.undo()
  ours = np.asarray(models.build(cfg).apply({"params": params}, TOKENS))
  assert np.max(np.abs(ours - hf_logits(model))) <= 1e-4
