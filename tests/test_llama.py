"""Llama: the Flax model against a plain numpy Llama, RoPE's relative positions, training and layouts."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import load_config_file, train_losses
from levanter_flax import models
from levanter_flax.training import step
from levanter_flax.config import to_run_config
from levanter_flax.core.errors import UserError
from levanter_flax.models.llama import LlamaConfig, rope_frequencies, rotary_embedding
from levanter_flax.training.loop import train_and_evaluate
from levanter_flax.models.common import ComputeConfig, with_compute

SMALL = LlamaConfig(vocab_size=61, seq_len=16, num_layers=2, num_heads=4, num_kv_heads=2,
                    hidden_dim=32, intermediate_dim=48, rope_theta=500.0,
                    compute=ComputeConfig(attention_impl="xla"))


def reference_logits(params, tokens, cfg: LlamaConfig) -> np.ndarray:
  """Llama written out in numpy, one operation at a time, as in the paper and HF's code."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  batch, length = tokens.shape

  def rms(x, scale):
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + cfg.rms_norm_epsilon) * scale

  def rope(x):  # x: [batch, length, heads, head_dim]
    half = head_dim // 2
    angles = np.arange(length)[:, None] * cfg.rope_theta ** (-np.arange(half) * 2 / head_dim)
    cos, sin = np.cos(angles)[None, :, None], np.sin(angles)[None, :, None]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

  x = p["embed_tokens"]["embedding"][tokens]
  causal = np.tril(np.ones((length, length), bool))
  for i in range(cfg.num_layers):
    layer = p[f"layers_{i}"]
    attn = layer["self_attn"]
    h = rms(x, layer["input_layernorm"]["scale"])
    q = rope((h @ attn["q_proj"]["kernel"]).reshape(batch, length, heads, head_dim))
    k = rope((h @ attn["k_proj"]["kernel"]).reshape(batch, length, kv_heads, head_dim))
    v = (h @ attn["v_proj"]["kernel"]).reshape(batch, length, kv_heads, head_dim)
    k, v = (np.repeat(t, heads // kv_heads, axis=2) for t in (k, v))  # Query head n uses kv head n // group.
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(head_dim)
    scores = np.where(causal, scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, length, heads * head_dim)
    x = x + out @ attn["o_proj"]["kernel"]
    h = rms(x, layer["post_attention_layernorm"]["scale"])
    mlp = layer["mlp"]
    gate = h @ mlp["gate_proj"]["kernel"]
    x = x + (gate / (1 + np.exp(-gate)) * (h @ mlp["up_proj"]["kernel"])) @ mlp["down_proj"]["kernel"]
  return rms(x, p["norm"]["scale"]) @ p["lm_head"]["kernel"]


def random_params(model, cfg, seed=0):
  params = model.init(jax.random.key(seed), jnp.zeros((1, cfg.seq_len), jnp.int32))["params"]
  # Non-trivial norm scales, so a wrong norm placement cannot hide behind scale 1.
  keys = iter(jax.random.split(jax.random.key(seed + 1), 64))
  return jax.tree_util.tree_map_with_path(
      lambda path, x: x + 0.3 * jax.random.normal(next(keys), x.shape)
      if path[-1].key == "scale" else x, params)


def test_logits_match_a_numpy_llama():
  model = models.build(SMALL)
  params = random_params(model, SMALL)
  tokens = np.random.default_rng(0).integers(0, SMALL.vocab_size, (2, SMALL.seq_len))
  np.testing.assert_allclose(model.apply({"params": params}, tokens),
                             reference_logits(params, tokens, SMALL), atol=1e-4, rtol=1e-4)


def test_scanned_layers_give_the_same_logits():
  model, scanned = models.build(SMALL), models.build(with_compute(SMALL, scan_layers=True))
  params = random_params(model, SMALL)
  stacked = {k: v for k, v in params.items() if not k.startswith("layers_")}
  stacked["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs),
                                   *[params[f"layers_{i}"] for i in range(SMALL.num_layers)])
  tokens = np.random.default_rng(1).integers(0, SMALL.vocab_size, (2, SMALL.seq_len))
  np.testing.assert_allclose(scanned.apply({"params": stacked}, tokens),
                             model.apply({"params": params}, tokens), atol=1e-5)


def dataclasses_replace(cfg, **changes):
  import dataclasses
  return dataclasses.replace(cfg, **changes)


def test_rope_scores_depend_only_on_the_distance_between_positions():
  rng = np.random.default_rng(2)
  q, k = (jnp.asarray(rng.normal(size=(1, 1, 1, 8)), jnp.float32) for _ in range(2))

  def score(query_position, key_position):
    frequencies = rope_frequencies(dataclasses_replace(SMALL, rope_theta=10000.0))  # head_dim 8.
    rotate = lambda x, pos: rotary_embedding(x, jnp.array([[pos]]), frequencies)
    return float(jnp.sum(rotate(q, query_position) * rotate(k, key_position)))
  assert score(7, 3) == pytest.approx(score(104, 100), rel=1e-4)
  assert score(7, 3) != pytest.approx(score(7, 5), rel=1e-2)


def test_rope_on_bfloat16_heads_of_64_rounds_once():
  """The half rotation's partners come from a product with a signed permutation, exact in
  bfloat16: the rotated queries are the float64 rotation rounded once to bfloat16."""
  x = jax.random.normal(jax.random.key(0), (2, 16, 4, 64), jnp.bfloat16)
  frequencies = rope_frequencies(dataclasses_replace(SMALL, hidden_dim=256, rope_theta=10000.0))
  rotated = np.asarray(rotary_embedding(x, jnp.arange(16)[None], frequencies, scale=0.9),
                       np.float64)
  x64, angles = np.asarray(x, np.float64), np.arange(16)[:, None] * np.float64(frequencies)
  cos, sin = 0.9 * np.cos(angles)[None, :, None], 0.9 * np.sin(angles)[None, :, None]
  first, second = x64[..., :32], x64[..., 32:]
  expected = np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
  np.testing.assert_allclose(rotated, expected, rtol=2**-8, atol=1e-6)


def test_rope_gradient_on_bfloat16_heads_is_rounded_once():
  """The gradient stays float32 until one rounding to bfloat16: that of the float32 rotation
  (rounded twice, a quarter of its elements differed)."""
  x = jax.random.normal(jax.random.key(0), (2, 16, 4, 64), jnp.bfloat16)
  # bfloat16 values: the bfloat16 output's cotangent is the same in both.
  upstream = jax.random.normal(jax.random.key(1), x.shape, jnp.bfloat16).astype(jnp.float32)
  frequencies = rope_frequencies(dataclasses_replace(SMALL, hidden_dim=256, rope_theta=10000.0))
  gradient = lambda x: jax.grad(lambda x: jnp.sum(rotary_embedding(
      x, jnp.arange(16)[None], frequencies).astype(jnp.float32) * upstream))(x)
  np.testing.assert_array_equal(gradient(x), gradient(x.astype(jnp.float32)).astype(jnp.bfloat16))


def test_an_unknown_rope_type_in_the_config_is_refused():
  config = load_config_file("llama_nano")
  config.model.rope_type = "longrope"
  with pytest.raises(UserError, match=r"config.model.rope_type must be one of default, linear, "
                                      r"llama3, yarn; got 'longrope'"):
    to_run_config(config)
  config.model.rope_type = "yarn"
  config.model.rope_beta_slow = 40.0
  with pytest.raises(UserError, match=r"config.model.rope_beta_slow \(40.0\) must be positive "
                                      r"and below rope_beta_fast \(32.0\)"):
    to_run_config(config)


def test_blockwise_cross_entropy_uses_the_untied_head():
  model = models.build(SMALL)
  blockwise = models.build(with_compute(SMALL, cross_entropy_block_size=16))
  params = random_params(model, SMALL)
  tokens = jnp.asarray(np.random.default_rng(3).integers(0, SMALL.vocab_size, (2, SMALL.seq_len)))
  assert float(step.next_token_loss(blockwise, params, tokens)) == pytest.approx(
      float(step.next_token_loss(model, params, tokens)), rel=1e-5)


@pytest.fixture
def tiny_llama(data_cache):
  config = load_config_file("llama_nano")
  config.model.seq_len = 64
  config.model.num_layers = 2
  config.model.hidden_dim = 64
  config.model.intermediate_dim = 128
  config.trainer.batch_size = 8
  config.trainer.log_every_steps = 1
  config.trainer.eval_every_steps = 1000
  config.trainer.eval_tokens = 512
  config.optimizer.warmup_steps = 2
  config.data.cache_dir = str(data_cache)
  return config


@pytest.mark.slow
def test_llama_nano_learns(tiny_llama, tmp_path):
  tiny_llama.trainer.num_train_steps = 30
  train_and_evaluate(to_run_config(tiny_llama), tmp_path)
  losses = train_losses(tmp_path)
  assert np.mean([losses[s] for s in (28, 29, 30)]) < losses[1] - 1.5, losses
