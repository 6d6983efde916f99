"""Optimizers: each one trains, Sophia-H's Hessian estimate and update and Muon's step against
references, Muon's groups by role and under ZeRO-3; each schedule against its formula."""
import dataclasses
import itertools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import train_losses
from levanter_flax import models
from levanter_flax.optim import optimizers
from levanter_flax.config import default_config, load_preset, to_run_config
from levanter_flax.core.errors import UserError
from levanter_flax.training.loop import train_and_evaluate
from levanter_flax.models.common import ComputeConfig
from levanter_flax.parallel.partitioning import path_name

A = np.array([[3.0, 0.5, -1.0, 0.2], [0.5, 2.0, 0.3, 0.0], [-1.0, 0.3, 1.5, 0.4],
              [0.2, 0.0, 0.4, 0.7]], np.float32)


def quadratic(x):
  return 0.5 * x @ A @ x


def test_hutchinson_estimate_is_the_hessian_diagonal_in_expectation():
  x = jnp.array([0.3, -1.0, 2.0, 0.5])
  signs = [jnp.array(s, jnp.float32) for s in itertools.product([-1.0, 1.0], repeat=4)]
  exact_mean = np.mean([optimizers.hessian_diagonal_estimate(quadratic, x, u) for u in signs], axis=0)
  np.testing.assert_allclose(exact_mean, np.diag(A), rtol=1e-6)  # Every Rademacher vector once.
  sampled = np.mean([optimizers.hessian_diagonal_estimate(
      quadratic, x, optimizers.rademacher_like(jax.random.PRNGKey(i), x)) for i in range(400)], axis=0)
  np.testing.assert_allclose(sampled, np.diag(A), atol=0.15)
  single = optimizers.hessian_diagonal_estimate(quadratic, x, signs[5])
  assert not np.allclose(single, np.diag(A))  # One sample alone is noisy: the test can fail.


def test_sophia_h_update_matches_the_papers_algorithm():
  lr, b1, b2, gamma, eps, decay = 0.1, 0.9, 0.8, 0.5, 1e-12, 0.01
  transform = optimizers.sophia_h(lr, b1=b1, b2=b2, gamma=gamma, eps=eps, weight_decay=decay,
                                  update_interval=2)
  params = {"kernel": jnp.array([0.3, -1.0, 2.0, 0.5])}
  loss_fn = lambda p: quadratic(p["kernel"])
  state = transform.init(params)
  m, h, x, key = np.zeros(4), np.zeros(4), np.array(params["kernel"]), state.key
  for step in range(4):
    grads = jax.grad(loss_fn)(params)
    updates, state = transform.update(grads, state, params, loss_fn=loss_fn)
    params = jax.tree.map(jnp.add, params, updates)
    # The reference, in numpy.
    key, sample_key = jax.random.split(key)
    m = b1 * m + (1 - b1) * (A @ x)
    if step % 2 == 0:
      u = np.asarray(optimizers.rademacher_like(sample_key, {"kernel": jnp.asarray(x)})["kernel"])
      h = b2 * h + (1 - b2) * u * (A @ u)
    x = x - lr * (np.clip(m / np.maximum(gamma * h, eps), -1, 1) + decay * x)
    np.testing.assert_allclose(params["kernel"], x, rtol=1e-5, atol=1e-6, err_msg=f"step {step}")


@pytest.mark.slow
@pytest.mark.parametrize("name, learning_rate", [("adamw", 3e-3), ("lion", 1e-3),
                                                  ("adafactor", 3e-2), ("sophia_h", 3e-3),
                                                  ("muon", 3e-3)])
def test_each_optimizer_reduces_the_nano_loss(tiny_config, tmp_path, name, learning_rate):
  tiny_config.optimizer.name = name
  tiny_config.optimizer.learning_rate = learning_rate
  tiny_config.trainer.num_train_steps = 20
  tiny_config.trainer.eval_every_steps = 20
  tiny_config.checkpoint.every_steps = 20
  train_and_evaluate(to_run_config(tiny_config), tmp_path)
  losses = train_losses(tmp_path)
  assert np.mean([losses[s] for s in (18, 19, 20)]) < losses[1] - 0.5, losses


def test_a_preset_fills_the_optimizer_section():
  config = default_config()
  config.optimizer.update(load_preset("optim/sophia_h_large"))  # By its name.
  optimizer = to_run_config(config).optimizer
  assert (optimizer.name, optimizer.beta1, optimizer.epsilon) == ("sophia_h", 0.965, 1e-12)


# Schedules: each against its formula, written here.
PEAK, WARMUP, STEPS, END_RATIO = 1e-3, 10, 100, 0.1
END = PEAK * END_RATIO
CHOSEN_STEPS = (0, 4, 10, 35, 69, 70, 71, 85, 99, 100, 130)


def schedule_config(schedule: str, **fields) -> optimizers.OptimizerConfig:
  return optimizers.OptimizerConfig(learning_rate=PEAK, warmup_steps=WARMUP,
                                    min_learning_rate_ratio=END_RATIO, schedule=schedule, **fields)


def expected_rate(schedule: str, step: int, decay_start: int = 70, shape: str = "linear") -> float:
  if step < WARMUP:
    return PEAK * step / WARMUP
  if schedule == "constant":
    return PEAK
  if schedule == "cosine":
    t = min((step - WARMUP) / (STEPS - WARMUP), 1.0)
    return END + (PEAK - END) * 0.5 * (1 + math.cos(math.pi * t))
  if schedule == "linear":
    return PEAK + (END - PEAK) * min((step - WARMUP) / (STEPS - WARMUP), 1.0)
  if step < decay_start:  # wsd
    return PEAK
  t = min((step - decay_start) / (STEPS - decay_start), 1.0)
  return END + (PEAK - END) * (1 - (math.sqrt(t) if shape == "sqrt" else t))


@pytest.mark.parametrize("schedule, fields", [
    ("cosine", {}), ("linear", {}), ("constant", {}),
    ("wsd", {"decay_fraction": 0.3}), ("wsd", {"decay_fraction": 0.3, "decay_shape": "sqrt"})])
def test_each_schedule_follows_its_formula(schedule, fields):
  cfg = schedule_config(schedule, **fields)
  rates = optimizers.learning_rate_schedule(cfg, STEPS)
  for step in CHOSEN_STEPS:
    np.testing.assert_allclose(float(rates(step)), expected_rate(schedule, step, shape=cfg.decay_shape),
                               rtol=1e-5, atol=1e-10, err_msg=f"{schedule} step {step}")


def test_a_wsd_run_extended_before_its_decay_stays_stable():
  """The schedule is a function of (step, num_train_steps): a run resumed with 3x the steps before
  step 80, where its decay would have begun, goes on at the peak; at 80 the shorter run decays."""
  cfg = schedule_config("wsd", decay_fraction=0.2)
  short, extended = (optimizers.learning_rate_schedule(cfg, n) for n in (STEPS, 3 * STEPS))
  stable = np.arange(WARMUP, 80)
  np.testing.assert_array_equal(short(stable), np.full(stable.shape, PEAK, np.float32))
  np.testing.assert_array_equal(extended(stable), short(stable))
  np.testing.assert_array_equal(extended(np.arange(80, 240)), np.float32(PEAK))  # Stable on.
  assert float(short(90)) < PEAK and float(extended(270)) < PEAK  # Each decays at its end.
  np.testing.assert_allclose(float(extended(3 * STEPS)), END, rtol=1e-5)


# Muon.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # optax.contrib's (Keller Jordan's) quintic.


def newton_schulz(g: np.ndarray, steps: int = 5, eps: float = 1e-8) -> np.ndarray:
  """The quintic Newton-Schulz iteration on the wide orientation of g, as optax runs it."""
  tall = g.shape[0] > g.shape[1]
  x = g.T if tall else g
  x = x / (np.linalg.norm(x) + eps)
  a, b, c = NS_COEFFICIENTS
  for _ in range(steps):
    gram = x @ x.T
    x = a * x + (b * gram + c * gram @ gram) @ x
  return x.T if tall else x


def muon_reference(w, grads, lr, beta, weight_decay, rms):
  """Muon on one [in, out] matrix over a list of gradients: Nesterov momentum with bias
  correction, orthogonalized, scaled to RMS `rms` (sqrt(max(in, out)) * rms), decoupled decay."""
  mu = np.zeros_like(w)
  for t, g in enumerate(grads, start=1):
    mu = beta * mu + (1 - beta) * g
    nesterov = beta * mu / (1 - beta ** (t + 1)) + (1 - beta) * g / (1 - beta ** t)
    update = newton_schulz(nesterov) * math.sqrt(max(w.shape)) * rms
    w = w - lr * (update + weight_decay * w)
  return w


def leaf_at(tree, keys):
  for key in keys:
    tree = tree[key]
  return tree


def test_muon_steps_match_a_numpy_newton_schulz_reference():
  """A scanned (stacked) [layers, in, out] kernel: each layer's matrix on its own. The embedding
  takes AdamW's first step (sign of the gradient) with decay; a norm scale, without."""
  lr, beta, decay, rms = 0.05, 0.9, 0.1, 0.2
  cfg = optimizers.OptimizerConfig(name="muon", learning_rate=lr, warmup_steps=0, schedule="constant",
                                   min_learning_rate_ratio=0.0, max_grad_norm=0.0, weight_decay=decay,
                                   muon_momentum=beta, muon_update_rms=rms)
  rng = np.random.default_rng(0)
  params = {"params": {"h": {"mlp": {"kernel": rng.normal(size=(2, 6, 4)).astype(np.float32)},
                             "ln": {"scale": np.ones((2, 4), np.float32)}},
                       "wte": {"embedding": rng.normal(size=(5, 4)).astype(np.float32)}}}
  grads = [jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), params)
           for _ in range(3)]
  transform = optimizers.make_optimizer(cfg, optimizers.learning_rate_schedule(cfg, 100))
  state, trained = transform.init(params), params
  for step, g in enumerate(grads):
    updates, state = jax.jit(transform.update)(g, state, trained)
    trained = jax.tree.map(jnp.add, trained, updates)
    if step == 0:  # Adam's first step, m / sqrt(v), is the gradient's sign.
      for keys, rate in ((("wte", "embedding"), decay), (("h", "ln", "scale"), 0.0)):
        before, after, grad = (leaf_at(tree["params"], keys) for tree in (params, trained, g))
        np.testing.assert_allclose(after, before - lr * (np.sign(grad) + rate * before), rtol=1e-5,
                                   err_msg="/".join(keys))
  kernel = params["params"]["h"]["mlp"]["kernel"].astype(np.float64)
  for layer in range(2):
    expected = muon_reference(kernel[layer], [g["params"]["h"]["mlp"]["kernel"][layer] for g in grads],
                              lr, beta, decay, rms)
    np.testing.assert_allclose(trained["params"]["h"]["mlp"]["kernel"][layer], expected, rtol=1e-4,
                               atol=1e-5, err_msg=f"layer {layer}")


def adamw_group(name: str, scan_layers: bool = False, **sizes) -> tuple[set[str], set[str]]:
  """The tiny model's parameter names in Muon's AdamW group, and all of them."""
  family = models.FAMILIES[name]
  fields = {f.name for f in dataclasses.fields(family.config)}
  config = family.config(**{k: v for k, v in TINY_SIZES.items() if k in fields}, **sizes,
                         compute=ComputeConfig(scan_layers=scan_layers))
  params = jax.eval_shape(lambda: models.build(config).init(
      jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
  labels = {path_name(p): label for p, label in
            jax.tree_util.tree_leaves_with_path(optimizers.muon_labels(params))}
  return {n for n, label in labels.items() if label == "adamw"}, set(labels)


TINY_SIZES = dict(vocab_size=384, seq_len=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  hidden_dim=64, intermediate_dim=96)
GPT2_LAYER_ADAMW = ("ln_1/scale", "ln_1/bias", "ln_2/scale", "ln_2/bias", "attn/c_attn/bias",
                    "attn/c_proj/bias", "mlp/c_fc/bias", "mlp/c_proj/bias")
LLAMA_LAYER_ADAMW = ("input_layernorm/scale", "post_attention_layernorm/scale")


@pytest.mark.parametrize("scan_layers", [False, True])
def test_muons_adamw_group_is_the_embeddings_head_norms_and_biases(scan_layers):
  layers = ["h"] if scan_layers else ["h_0", "h_1"]
  adamw, _ = adamw_group("gpt2", scan_layers)
  assert adamw == {"wte/embedding", "wpe/embedding", "ln_f/scale", "ln_f/bias"} | {
      f"{layer}/{name}" for layer in layers for name in GPT2_LAYER_ADAMW}
  layers = ["layers"] if scan_layers else ["layers_0", "layers_1"]
  adamw, names = adamw_group("llama", scan_layers)
  assert adamw == {"embed_tokens/embedding", "lm_head/kernel", "norm/scale"} | {
      f"{layer}/{name}" for layer in layers for name in LLAMA_LAYER_ADAMW}
  assert f"{layers[0]}/self_attn/q_proj/kernel" in names - adamw  # Muon's.


def test_muon_takes_each_experts_matrix():
  adamw, names = adamw_group("mixtral")
  assert {"layers_0/mlp/experts/up_proj", "layers_0/mlp/gate/kernel"} <= names - adamw
  cfg = optimizers.OptimizerConfig(name="muon")
  transform = optimizers.make_optimizer(cfg, optimizers.learning_rate_schedule(cfg, 100))
  experts = {"params": {"experts": {"up_proj": jnp.ones((8, 64, 96))}}}
  muon_state = jax.tree.leaves(transform.init(experts),
                               is_leaf=lambda x: isinstance(x, optax.contrib.MuonState))
  assert any(isinstance(s, optax.contrib.MuonState) for s in muon_state)


def test_muon_refuses_a_parameter_of_neither_group():
  cfg = optimizers.OptimizerConfig(name="muon")
  transform = optimizers.make_optimizer(cfg, optimizers.learning_rate_schedule(cfg, 100))
  params = {"params": {"layers_0": {"attn": {"kernel": jnp.ones((4, 4)),
                                             "rotary_weight": jnp.ones((4, 4))}}}}
  with pytest.raises(UserError, match=re.escape(
      "optimizer muon: parameter layers_0/attn/rotary_weight is neither a matrix for Muon (a "
      "kernel, an expert stack or a LoRA adapter) nor in the AdamW group (embeddings, lm_head, "
      "norm scales, biases)")):
    transform.init(params)


MUON_STEPS = 10


def train_with_muon(device_mesh, sharding, devices=None):
  from test_partitioning import OPTIMIZER, train
  return train(device_mesh, sharding, devices=devices, num_steps=MUON_STEPS,
               optimizer=dataclasses.replace(OPTIMIZER, name="muon"))


@pytest.fixture(scope="module")
def muon_on_one_device():
  from test_partitioning import sharding_config
  return train_with_muon((("data", 1),), sharding_config(), devices=jax.devices()[:1])


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["data8_zero3", "data2_model4_zero3"])
def test_muon_under_zero3_and_tensor_parallelism_trains_as_on_one_device(layout,
                                                                         muon_on_one_device):
  from test_partitioning import LAYOUTS, spec_of
  one, one_state = muon_on_one_device
  eight, state = train_with_muon(*LAYOUTS[layout])
  assert "data" in spec_of(state.params["h_0"]["mlp"]["c_fc"]["kernel"])  # ZeRO-3 splits it.
  np.testing.assert_allclose(eight, one, rtol=1e-5)
  assert one[-1] < one[0] - 0.2, one  # It learns the random tokens' unigram distribution.
  # Each tensor as a whole: Newton-Schulz amplifies the layouts' other orders of summation in a
  # few elements (one bias element of 192 was 1.3e-5 off on another x86 CPU), not in the norm.
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(state.params),
                          jax.tree.leaves(one_state.params)):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    rms = lambda a: float(np.sqrt(np.mean(np.square(a))))
    assert rms(x - y) <= 1e-6 + 1e-4 * rms(y), (path_name(path), rms(x - y), rms(y))


@pytest.mark.slow
def test_a_muon_wsd_run_extended_from_its_checkpoint_trains_as_one_longer_run(tiny_config,
                                                                              tmp_path):
  """5 steps, then resumed to 10, against 10 straight. With decay_fraction 0.2 the 5-step run's
  one decay step lowers the rate only after its last update (count 4 is the decay's t=0), so every
  update it made was one of the 10-step run's; the restored Muon state (momenta of the matrices,
  AdamW's moments of the rest) carries on."""
  tiny_config.optimizer.name = "muon"
  tiny_config.optimizer.schedule, tiny_config.optimizer.decay_fraction = "wsd", 0.2
  straight = tmp_path / "straight"
  train_and_evaluate(to_run_config(tiny_config), straight)
  resumed = tmp_path / "resumed"
  tiny_config.trainer.num_train_steps = 5
  train_and_evaluate(to_run_config(tiny_config), resumed)
  tiny_config.trainer.num_train_steps = 10
  train_and_evaluate(to_run_config(tiny_config), resumed)
  expected, got = train_losses(straight), train_losses(resumed)
  assert sorted(got) == list(range(1, 11))
  for step in range(1, 11):
    assert got[step] == pytest.approx(expected[step], rel=1e-6), step
