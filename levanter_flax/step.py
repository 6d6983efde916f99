"""The jitted train and eval steps: next-token loss, gradients, optimizer update."""
from typing import Any, Callable

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


def init_state(model: nn.Module, optimizer: optax.GradientTransformation,
               rng: jax.Array, seq_len: int) -> TrainState:
  params = model.init(rng, jnp.zeros((1, seq_len), jnp.int32))["params"]
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=optimizer.init(params))


def next_token_loss(model: nn.Module, params, tokens: jax.Array) -> jax.Array:
  """Mean cross-entropy of predicting tokens[:, 1:] from tokens[:, :-1], in float32."""
  logits = model.apply({"params": params}, tokens)[:, :-1].astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def make_train_step(model: nn.Module, optimizer: optax.GradientTransformation,
                    schedule: optax.Schedule) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
  def train_step(state: TrainState, batch: Batch):
    loss, grads = jax.value_and_grad(lambda p: next_token_loss(model, p, batch["tokens"]))(state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    new_state = state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                              opt_state=opt_state)
    metrics = {
        "train/loss": loss,
        "train/grad_norm": optax.tree.norm(grads),
        "train/learning_rate": schedule(state.step),
    }
    return new_state, metrics
  return train_step


def make_eval_step(model: nn.Module) -> Callable[[Any, Batch], Metrics]:
  def eval_step(params, batch: Batch):
    return {"eval/loss": next_token_loss(model, params, batch["tokens"])}
  return eval_step


def jit_train_step(train_step, state_shardings, batch_sharding, replicated):
  return jax.jit(train_step, in_shardings=(state_shardings, batch_sharding),
                 out_shardings=(state_shardings, replicated), donate_argnums=(0,))


def jit_eval_step(eval_step, param_shardings, batch_sharding, replicated):
  return jax.jit(eval_step, in_shardings=(param_shardings, batch_sharding),
                 out_shardings=replicated)
