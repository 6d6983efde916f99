"""LoRA (config.model.lora): adapters trained on a frozen base, exported merged or for peft."""
import dataclasses
import json
import re
import signal
import sys

import flax
import jax
import numpy as np
import orbax.checkpoint as ocp
import peft
import pytest
import safetensors
import torch
import transformers

import forkserver
from conftest import REPO, load_config_file, train_losses
from levanter_flax.core import flops
from levanter_flax.hf import snapshot
from levanter_flax import models
from levanter_flax.parallel import partitioning
from levanter_flax.training import step
from levanter_flax.generate.export import write_adapter
from levanter_flax.generate.trained import run_params
from levanter_flax.config import to_run_config
from levanter_flax.core.errors import UserError
from levanter_flax.models import common, lora
from levanter_flax.training.loop import train_and_evaluate
from test_hf import assert_one_error_line, export, tiny_llama  # pylint: disable=unused-import
from test_resume import run_killed_after_checkpoint

TOKENS = np.random.default_rng(0).integers(0, 256, (2, 24))


def _hf_base(architecture: str, directory):
  """A tiny seeded transformers model of the nano configs' shape, saved to `directory`."""
  torch.manual_seed(0)
  if architecture == "llama":
    config = transformers.LlamaConfig(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, tie_word_embeddings=False)
  else:
    config = transformers.GPT2Config(vocab_size=384, n_positions=64, n_embd=64, n_layer=2,
                                     n_head=4)
  transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
  return directory


def _torch_logits(model) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor(TOKENS)).logits.numpy()


def _our_logits(model_cfg, params) -> np.ndarray:
  return np.asarray(models.build(model_cfg).apply({"params": params}, TOKENS))


@pytest.fixture
def tiny_gpt2(tiny_config):
  tiny_config.model.vocab_size = 384
  tiny_config.trainer.eval_tokens = 512
  return tiny_config


@pytest.mark.slow
@pytest.mark.parametrize("architecture, scan_layers", [("llama", False), ("gpt2", True)])
def test_adapters_alone_train_on_a_frozen_hf_base_and_export_merged_or_to_peft(
    architecture, scan_layers, tiny_llama, tiny_gpt2, tmp_path):
  config = tiny_llama if architecture == "llama" else tiny_gpt2
  base_dir = _hf_base(architecture, tmp_path / "hf")
  config.trainer.init_from_hf = str(base_dir)
  config.model.compute.scan_layers = scan_layers
  config.model.lora.rank, config.model.lora.alpha = 4, 16.0
  config.trainer.num_train_steps, config.checkpoint.every_steps = 3, 3
  config.optimizer.learning_rate, config.optimizer.warmup_steps = 1e-2, 1
  train_and_evaluate(to_run_config(config), tmp_path / "run")

  # The base is the HF checkpoint's, bit for bit; the adapters moved (B is zero at init).
  model_cfg, params, _ = run_params(tmp_path / "run")
  base, adapters = lora.split(params)
  _, loaded = snapshot.load(base_dir, scan_layers)
  assert jax.tree.structure(base) == jax.tree.structure(loaded)
  for ours, theirs in zip(jax.tree.leaves(base), jax.tree.leaves(loaded)):
    np.testing.assert_array_equal(np.asarray(ours), theirs)
  assert all(np.abs(b).max() > 0 for _, b in lora.adapters_of(adapters).values())
  # A checkpoint holds the adapters and their optimizer state, never the base.
  saved = ocp.StandardCheckpointer().restore((tmp_path / "run" / "checkpoints" / "3" / "state"))
  saved_names = [partitioning.path_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(
      saved["params"])]
  assert saved_names and all(lora.is_adapter(name) for name in saved_names)
  ours = _our_logits(model_cfg, params)
  assert np.abs(ours - _our_logits(lora.without_lora(model_cfg), base)).max() > 1e-3

  assert_one_error_line(export(tmp_path / "run", tmp_path / "plain"),
                        "trains LoRA adapters (config.model.lora.rank 4): pass --merge_lora")
  out = tmp_path / "export"
  result = export(tmp_path / "run", out, "--adapter")
  assert result.returncode == 0, result.stderr[-3000:]
  adapter_config = json.loads((out / "adapter_config.json").read_text())
  assert (adapter_config["r"], adapter_config["lora_alpha"]) == (4, 16.0)
  assert adapter_config["base_model_name_or_path"] == str(base_dir)
  base_model = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
  adapted = peft.PeftModel.from_pretrained(base_model, out).eval()
  assert np.abs(_torch_logits(adapted) - ours).max() <= 1e-4

  # Over it, a merged export leaves none of the adapter's files that transformers would follow.
  result = export(tmp_path / "run", out, "--merge_lora", "--overwrite")
  assert result.returncode == 0, result.stderr[-3000:]
  merged = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert np.abs(_torch_logits(merged) - ours).max() <= 1e-4
  # And an adapter over that, in bfloat16, no model's config.json.
  result = export(tmp_path / "run", out, "--adapter", "--overwrite", "--dtype=bfloat16")
  assert result.returncode == 0, result.stderr[-3000:]
  assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json",
                                                   "adapter_model.safetensors"]
  with safetensors.safe_open(out / "adapter_model.safetensors", "np") as f:
    assert {str(f.get_slice(k).get_dtype()) for k in f.keys()} == {"BF16"}


def test_only_the_adapters_change_and_their_optimizer_state_is_all_there_is(tiny_gpt2):
  tiny_gpt2.model.lora.rank = 2
  run = to_run_config(tiny_gpt2)
  mesh = partitioning.make_mesh(run.trainer.device_mesh)
  partitioner = partitioning.Partitioner(mesh, run.sharding)
  steps = step.build(run, partitioner)
  tokens = np.random.default_rng(0).integers(0, 384, (8, 64)).astype(np.int32)
  with partitioner.activation_context():
    state = steps.init(jax.random.key(0))
    base = jax.device_get(state.frozen)
    batch = {"tokens": jax.device_put(tokens, steps.batch_sharding)}
    for _ in range(3):
      state, _ = steps.train_step(state, batch)
  for before, after in zip(jax.tree.leaves(base), jax.tree.leaves(state.frozen)):
    np.testing.assert_array_equal(before, np.asarray(after))
  names = [partitioning.path_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(state.params)]
  assert names and all(lora.is_adapter(name) for name in names)
  assert all(np.abs(np.asarray(b)).max() > 0 for _, b in lora.adapters_of(state.params).values())
  adapter_size = sum(x.size for x in jax.tree.leaves(state.params))
  assert sum(x.size for x in jax.tree.leaves(state.opt_state)) <= 2 * adapter_size + 2
  # MFU's FLOPs: the frozen base's weights get no gradient, so 4 FLOPs a token each, not 6.
  cfg = run.model
  attention = flops.flops_per_token(0, cfg.num_layers, cfg.num_heads, cfg.head_dim, cfg.seq_len)
  full = models.flops_per_token(cfg, state.model_params)
  frozen_matmuls = (full - attention) / 6 - adapter_size
  assert models.flops_per_token(cfg, state.model_params, frozen=state.frozen) == pytest.approx(
      full - 2 * frozen_matmuls)


def test_adapters_shard_like_their_kernels_axes():
  rules = models.FAMILIES["llama"].partition_rules
  mesh = partitioning.make_mesh((("data", 2), ("model", 4)))
  partitioner = partitioning.Partitioner(mesh, partitioning.ShardingConfig(
      rules=rules, parameter_axis="data", strict=True))
  spec = lambda name, shape: tuple(partitioner.param_spec(name, shape))
  assert spec("layers_0/self_attn/q_proj/kernel", (64, 64)) == ("data", "model")
  assert spec("layers_0/self_attn/q_proj/lora_a", (64, 8)) == ("data", None)
  # The rank has no rule: ZeRO-3 splits it where it is the one free dimension.
  assert spec("layers_0/self_attn/q_proj/lora_b", (8, 64)) == ("data", "model")
  assert spec("layers_0/mlp/down_proj/lora_a", (128, 8)) == ("model", "data")
  assert spec("layers_0/mlp/down_proj/lora_b", (8, 64)) == (None, "data")
  # An expert stack's adapters: split by expert as the stack, then like its input or output.
  partitioner = partitioning.Partitioner(mesh, partitioning.ShardingConfig(
      rules=models.FAMILIES["qwen3_moe"].partition_rules, expert_axis="data", tensor_axis="model",
      strict=True))
  assert spec("layers/mlp/experts/gate_proj_lora_a", (2, 4, 64, 8)) == (None, "data", None, None)
  assert spec("layers/mlp/experts/gate_proj_lora_b", (2, 4, 8, 64)) == (
      None, "data", None, "model")
  assert spec("layers/mlp/experts/down_proj_lora_a", (2, 4, 64, 8)) == (
      None, "data", "model", None)


def _merged_in_numpy(params: dict, scale: float) -> dict:
  """The plain model's params that compute what a LoRA model's do: each adapted kernel
  W + A B * scale, and each expert stack likewise expert by expert."""
  flat = {k: np.asarray(v, np.float64) for k, v in
          flax.traverse_util.flatten_dict(jax.device_get(params), sep="/").items()}
  plain = {k: v for k, v in flat.items() if not lora.is_adapter(k)}
  for key in flat:
    for a, b, weight in (("/lora_a", "/lora_b", "/kernel"), ("_lora_a", "_lora_b", "")):
      if key.endswith(a):
        stem = key[:-len(a)]
        plain[stem + weight] = plain[stem + weight] + scale * np.einsum(
            "...ir,...ro->...io", flat[key], flat[stem + b])
  return flax.traverse_util.unflatten_dict(plain, sep="/")


@pytest.mark.slow
def test_expert_adapters_train_on_a_frozen_hf_base_and_export_merged(data_cache, tmp_path):
  """Qwen3-MoE's expert stacks take an adapter per expert (peft's target_parameters);
  the base stays the HF checkpoint's, the model computes the plain one on W + A B * alpha / rank,
  and the merged export gives transformers' logits. A PEFT adapter export and input dropout are
  refused in one line."""
  torch.manual_seed(0)
  hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
      vocab_size=384, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
      num_experts=4, num_experts_per_tok=2, norm_topk_prob=True))
  with torch.no_grad():  # Decisive routing: a near tie could go either way in float32.
    for layer in hf.model.layers:
      layer.mlp.gate.weight.normal_(0, 0.5)
  hf.save_pretrained(tmp_path / "hf")
  config = load_config_file("qwen3_moe:nano")
  config.trainer.init_from_hf = str(tmp_path / "hf")
  config.model.compute.scan_layers = True
  config.model.lora.rank, config.model.lora.alpha = 4, 16.0
  config.model.lora.targets = lora.DEFAULT_TARGETS + "|" + lora.EXPERT_TARGETS
  config.trainer.batch_size, config.trainer.num_train_steps = 8, 3
  config.trainer.eval_tokens, config.data.cache_dir = 512, str(data_cache)
  config.optimizer.learning_rate, config.optimizer.warmup_steps = 1e-2, 1
  train_and_evaluate(to_run_config(config), tmp_path / "run")

  model_cfg, params, _ = run_params(tmp_path / "run")
  base, adapters = lora.split(params)
  _, loaded = snapshot.load(tmp_path / "hf", scan_layers=True)
  for ours, theirs in zip(jax.tree.leaves(base), jax.tree.leaves(loaded)):
    np.testing.assert_array_equal(np.asarray(ours), theirs)
  moved = {weight for weight, (_, b) in lora.adapters_of(adapters).items() if np.abs(b).max() > 0}
  assert {f"layers/mlp/experts/{name}" for name in ("gate_proj", "up_proj", "down_proj")} <= moved
  ours = _our_logits(model_cfg, params)
  plain = _our_logits(lora.without_lora(model_cfg), _merged_in_numpy(params, 16.0 / 4))
  assert np.abs(ours - plain).max() <= 1e-5

  with pytest.raises(UserError, match=r"--adapter: this run trains adapters on expert stacks"):
    write_adapter(model_cfg, params, {}, tmp_path / "adapter", "float32")
  result = export(tmp_path / "run", tmp_path / "merged", "--merge_lora")
  assert result.returncode == 0, result.stderr[-3000:]
  merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
  assert np.abs(_torch_logits(merged) - ours).max() <= 1e-4

  config.model.lora.dropout = 0.1
  with pytest.raises(UserError, match=r"config.model.lora.dropout must be 0 when "
                                      r"config.model.lora.targets takes expert stacks"):
    train_and_evaluate(to_run_config(config), tmp_path / "dropout")


@pytest.mark.slow
@pytest.mark.parametrize("scan_layers", [False, True])
def test_dropout_reaches_the_adapters_of_every_layer_scanned_or_not(tiny_gpt2, scan_layers):
  cfg = to_run_config(tiny_gpt2).model
  cfg = common.with_compute(dataclasses.replace(cfg, lora=dataclasses.replace(
      cfg.lora, rank=4, dropout=0.5)), scan_layers=scan_layers)
  params = jax.tree_util.tree_map_with_path(  # B is zero at init: dropout would change nothing.
      lambda path, x: x + 0.1 if "lora_b" in jax.tree_util.keystr(path) else x,
      models.init_params(cfg, jax.random.key(0)))
  tokens = np.arange(2 * cfg.seq_len).reshape(2, cfg.seq_len) % 256
  model = models.build(cfg)
  apply = lambda rngs: np.asarray(jax.jit(lambda r: model.apply({"params": params}, tokens,
                                                                rngs=r))(rngs))
  first, second = apply({"dropout": jax.random.key(1)}), apply({"dropout": jax.random.key(2)})
  assert np.abs(first - second).max() > 1e-3  # Dropped where each key says.
  np.testing.assert_array_equal(apply(None), apply(None))  # No key: no dropout (eval, sampling).


@pytest.mark.slow
def test_a_killed_lora_run_resumes_with_the_same_losses(data_cache, tmp_path):
  flags = [f"--config.data.cache_dir={data_cache}", "--config.trainer.batch_size=8",
           "--config.trainer.num_train_steps=4", "--config.checkpoint.every_steps=2",
           "--config.trainer.eval_every_steps=100", "--config.data.reader_groups=1",
           "--config.model.lora.rank=4", "--config.model.lora.dropout=0.1",
           "--config.optimizer.learning_rate=0.01"]
  killed = run_killed_after_checkpoint(tmp_path / "killed", 2, *flags)
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
  resumed = run_killed_after_checkpoint(tmp_path / "killed", None, *flags)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  whole = run_killed_after_checkpoint(tmp_path / "whole", None, *flags)
  assert whole.returncode == 0, whole.stderr[-2000:]
  assert train_losses(tmp_path / "killed") == train_losses(tmp_path / "whole")
  assert sorted(train_losses(tmp_path / "whole")) == [1, 2, 3, 4]


@pytest.mark.slow
def test_resuming_with_lora_switched_is_refused_and_adapter_export_needs_lora(tiny_gpt2,
                                                                              tmp_path):
  tiny_gpt2.trainer.num_train_steps = 2
  train_and_evaluate(to_run_config(tiny_gpt2), tmp_path / "full")
  assert_one_error_line(export(tmp_path / "full", tmp_path / "out", "--adapter"),
                        "--adapter: the run in")
  tiny_gpt2.model.lora.rank = 4
  with pytest.raises(UserError, match=r"cannot resume .* model.lora.rank 0 -> 4"):
    train_and_evaluate(to_run_config(tiny_gpt2), tmp_path / "full")
  train_and_evaluate(to_run_config(tiny_gpt2), tmp_path / "lora")
  tiny_gpt2.model.lora.rank = 0
  with pytest.raises(UserError, match=r"cannot resume .* model.lora.rank 4 -> 0"):
    train_and_evaluate(to_run_config(tiny_gpt2), tmp_path / "lora")


def test_a_target_regex_that_matches_nothing_is_named(tiny_gpt2, tmp_path):
  tiny_gpt2.model.lora.rank, tiny_gpt2.model.lora.targets = 4, "q_proj"
  with pytest.raises(UserError, match=r"config.model.lora.targets 'q_proj' matches no projection "
                                      r"of this gpt2 model; .* h/attn/c_attn/kernel"):
    train_and_evaluate(to_run_config(tiny_gpt2), tmp_path)
  tiny_gpt2.model.lora.targets = "("
  with pytest.raises(UserError, match=r"config.model.lora.targets: '\(' is not a valid regex"):
    to_run_config(tiny_gpt2)


def test_llama_1b_lora_rank_8_optimizer_state_is_at_most_2_percent_of_full_fine_tuning():
  result = forkserver.run([sys.executable, "memory.py", "--lora_rank=8"], cwd=REPO / "bench",
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  percent = float(re.search(r"LoRA rank 8 .* full .*: ([\d.]+)%", result.stdout).group(1))
  assert 0 < percent <= 2
