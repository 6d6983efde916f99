"""GPT-2: exact parameter counts, and logits against a plain NumPy GPT-2."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import load_config_file
from levanter_flax import models
from levanter_flax.training import step
from levanter_flax.config import to_run_config
from levanter_flax.models.gpt2 import GPT2Config, GPT2LMHeadModel
from levanter_flax.models.common import ComputeConfig, with_compute


def _num_params(config_name: str) -> int:
  cfg = to_run_config(load_config_file(config_name)).model
  shapes = jax.eval_shape(GPT2LMHeadModel(cfg).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
  return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))


@pytest.mark.parametrize("config_name, expected", [
    ("gpt2_small", 124_439_808),  # OpenAI's GPT-2 124M, vocab 50257, tied embeddings.
    ("gpt2_small_fast", 124_475_904),  # Vocab padded to 50304: 47 * 768 more.
    ("gpt2_medium", 354_823_168),  # OpenAI's GPT-2 medium.
])
def test_parameter_count(config_name, expected):
  assert _num_params(config_name) == expected


def _reference_gpt2(params, tokens, cfg: GPT2Config) -> np.ndarray:
  """GPT-2's forward pass written out in float64 NumPy, straight from the paper's recipe."""
  p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)

  def layer_norm(x, ln):
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + cfg.layer_norm_epsilon) * ln["scale"] + ln["bias"]

  def dense(x, d):
    return x @ d["kernel"] + d["bias"]

  def gelu(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))

  batch, length = tokens.shape
  x = p["wte"]["embedding"][tokens] + p["wpe"]["embedding"][:length][None]
  causal = np.tril(np.ones((length, length), bool))
  for i in range(cfg.num_layers):
    block = p[f"h_{i}"]
    q, k, v = np.split(dense(layer_norm(x, block["ln_1"]), block["attn"]["c_attn"]), 3, axis=-1)
    split = lambda t: t.reshape(batch, length, cfg.num_heads, cfg.head_dim).transpose(0, 2, 1, 3)
    scores = split(q) @ split(k).transpose(0, 1, 3, 2) / np.sqrt(cfg.head_dim)
    scores = np.where(causal, scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    attended = (probs @ split(v)).transpose(0, 2, 1, 3).reshape(batch, length, cfg.hidden_dim)
    x = x + dense(attended, block["attn"]["c_proj"])
    h = gelu(dense(layer_norm(x, block["ln_2"]), block["mlp"]["c_fc"]))
    x = x + dense(h, block["mlp"]["c_proj"])
  head = p["lm_head"]["kernel"] if "lm_head" in p else p["wte"]["embedding"].T
  return layer_norm(x, p["ln_f"]) @ head


@pytest.mark.parametrize("remat, attention_impl", [
    ("none", "xla"), ("full", "xla"), ("none", "auto"),
    pytest.param("none", "cudnn", marks=pytest.mark.skipif(
        jax.default_backend() != "gpu", reason="cuDNN attention needs an NVIDIA GPU")),
])
def test_logits_match_numpy_reference(remat, attention_impl):
  cfg = GPT2Config(vocab_size=97, seq_len=16, num_layers=2, num_heads=4, hidden_dim=32,
                   compute=ComputeConfig(remat=remat, attention_impl=attention_impl,
                                         dtype="bfloat16" if attention_impl == "cudnn" else "float32"))
  model = GPT2LMHeadModel(cfg)
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
  params = model.init(jax.random.key(0), tokens)["params"]
  # Random biases and LayerNorm params too, so a wrong wiring of any of them shows.
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(2), len(leaves))
  params = jax.tree.unflatten(treedef, [x + 0.1 * jax.random.normal(k, x.shape)
                                        for x, k in zip(leaves, keys)])
  logits = model.apply({"params": params}, tokens)
  expected = _reference_gpt2(params, np.asarray(tokens), cfg)
  tolerance = 1e-4 if cfg.compute.dtype == "float32" else 5e-2
  np.testing.assert_allclose(np.asarray(logits, np.float64), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.slow
def test_initialisation_scales_residual_projections():
  cfg = GPT2Config(vocab_size=512, seq_len=32, num_layers=8, num_heads=4, hidden_dim=256)
  params = GPT2LMHeadModel(cfg).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
  std = lambda x: float(np.std(np.asarray(x)))
  assert std(params["h_0"]["attn"]["c_attn"]["kernel"]) == pytest.approx(0.02, rel=0.05)
  assert std(params["h_0"]["mlp"]["c_proj"]["kernel"]) == pytest.approx(0.02 / 4, rel=0.05)
  assert std(params["h_0"]["attn"]["c_proj"]["kernel"]) == pytest.approx(0.02 / 4, rel=0.05)
  assert not np.any(np.asarray(params["h_0"]["attn"]["c_attn"]["bias"]))


def test_scanned_layers_equal_the_unrolled_model():
  cfg = GPT2Config(vocab_size=97, seq_len=16, num_layers=3, num_heads=4, hidden_dim=32)
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
  params = GPT2LMHeadModel(cfg).init(jax.random.key(0), tokens)["params"]
  stacked = {k: v for k, v in params.items() if not k.startswith("h_")}
  stacked["h"] = jax.tree.map(lambda *layers: jnp.stack(layers),
                              *[params[f"h_{i}"] for i in range(cfg.num_layers)])
  scanned = GPT2LMHeadModel(with_compute(cfg, scan_layers=True))
  assert jax.tree.structure(scanned.init(jax.random.key(0), tokens)["params"]) == jax.tree.structure(stacked)
  np.testing.assert_allclose(scanned.apply({"params": stacked}, tokens),
                             GPT2LMHeadModel(cfg).apply({"params": params}, tokens), rtol=1e-5, atol=1e-5)


def test_an_untied_head_is_its_own_matrix_in_logits_loss_and_flops():
  tied = GPT2Config(vocab_size=97, seq_len=16, num_layers=2, num_heads=4, hidden_dim=32)
  cfg = dataclasses.replace(tied, tie_word_embeddings=False)
  model = GPT2LMHeadModel(cfg)
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
  params = model.init(jax.random.key(0), tokens)["params"]
  assert params["lm_head"]["kernel"].shape == (32, 97) and "bias" not in params["lm_head"]
  params = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(5), x.shape), params)
  np.testing.assert_allclose(np.asarray(model.apply({"params": params}, tokens), np.float64),
                             _reference_gpt2(params, np.asarray(tokens), cfg), rtol=1e-4, atol=1e-4)
  np.testing.assert_array_equal(model.output_embedding(params), params["lm_head"]["kernel"].T)
  blockwise = GPT2LMHeadModel(with_compute(cfg, cross_entropy_block_size=16))
  assert float(step.next_token_loss(blockwise, params, tokens)) == pytest.approx(
      float(step.next_token_loss(model, params, tokens)), rel=1e-5)
  # The token embedding becomes a lookup and the head a matmul: the same FLOPs as tied.
  tied_params = GPT2LMHeadModel(tied).init(jax.random.key(0), tokens)["params"]
  count = lambda p: models.flops_per_token(cfg, p)
  assert count(params) == count(tied_params)
