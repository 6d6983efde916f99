"""Optimizers: each one trains, Sophia-H's Hessian estimate and update against references."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import train_losses
from levanter_flax import optim
from levanter_flax.config import default_config, load_preset, to_run_config
from levanter_flax.loop import train_and_evaluate

A = np.array([[3.0, 0.5, -1.0, 0.2], [0.5, 2.0, 0.3, 0.0], [-1.0, 0.3, 1.5, 0.4],
              [0.2, 0.0, 0.4, 0.7]], np.float32)


def quadratic(x):
  return 0.5 * x @ A @ x


def test_hutchinson_estimate_is_the_hessian_diagonal_in_expectation():
  x = jnp.array([0.3, -1.0, 2.0, 0.5])
  signs = [jnp.array(s, jnp.float32) for s in itertools.product([-1.0, 1.0], repeat=4)]
  exact_mean = np.mean([optim.hessian_diagonal_estimate(quadratic, x, u) for u in signs], axis=0)
  np.testing.assert_allclose(exact_mean, np.diag(A), rtol=1e-6)  # Every Rademacher vector once.
  sampled = np.mean([optim.hessian_diagonal_estimate(
      quadratic, x, optim.rademacher_like(jax.random.PRNGKey(i), x)) for i in range(400)], axis=0)
  np.testing.assert_allclose(sampled, np.diag(A), atol=0.15)
  single = optim.hessian_diagonal_estimate(quadratic, x, signs[5])
  assert not np.allclose(single, np.diag(A))  # One sample alone is noisy: the test can fail.


def test_sophia_h_update_matches_the_papers_algorithm():
  lr, b1, b2, gamma, eps, decay = 0.1, 0.9, 0.8, 0.5, 1e-12, 0.01
  transform = optim.sophia_h(lr, b1=b1, b2=b2, gamma=gamma, eps=eps, weight_decay=decay,
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
      u = np.asarray(optim.rademacher_like(sample_key, {"kernel": jnp.asarray(x)})["kernel"])
      h = b2 * h + (1 - b2) * u * (A @ u)
    x = x - lr * (np.clip(m / np.maximum(gamma * h, eps), -1, 1) + decay * x)
    np.testing.assert_allclose(params["kernel"], x, rtol=1e-5, atol=1e-6, err_msg=f"step {step}")


@pytest.mark.parametrize("name, learning_rate", [("adamw", 3e-3), ("lion", 1e-3),
                                                  ("adafactor", 3e-2), ("sophia_h", 3e-3)])
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
