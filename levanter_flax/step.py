"""The jitted train and eval steps: next-token loss, gradients, optimizer update."""
import dataclasses
import functools
from typing import Any, Callable

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from levanter_flax import models, partitioning

Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


def init_state(model: nn.Module, optimizer: optax.GradientTransformation,
               rng: jax.Array) -> TrainState:
  params = models.init_params(model.config, rng)
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=optimizer.init(params))


def blockwise_cross_entropy(hidden: jax.Array, embedding: jax.Array, labels: jax.Array,
                            block_size: int) -> jax.Array:
  """Mean cross-entropy of logits = hidden @ embedding.T, one vocabulary block at a time.

  A scan keeps a running max and sum of exponentials per token (an online
  logsumexp). Its body is checkpointed, so the backward pass recomputes each
  block's logits too: neither pass ever holds [tokens, vocab] floats, only
  [tokens, block_size]. Logits are float32, as in the plain loss.
  """
  hidden = hidden.reshape(-1, hidden.shape[-1])
  labels = labels.reshape(-1)
  vocab_size = embedding.shape[0]
  num_blocks = -(-vocab_size // block_size)
  padded = jnp.pad(embedding, ((0, num_blocks * block_size - vocab_size), (0, 0)))
  blocks = padded.reshape(num_blocks, block_size, -1).astype(hidden.dtype)

  @jax.checkpoint
  def add_block(carry, block):
    running_max, running_sum = carry
    index, weights = block
    logits = (hidden @ weights.T).astype(jnp.float32)
    in_vocab = index * block_size + jnp.arange(block_size) < vocab_size
    logits = jnp.where(in_vocab, logits, -jnp.inf)
    new_max = jnp.maximum(running_max, logits.max(axis=-1))
    running_sum = (running_sum * jnp.exp(running_max - new_max)
                   + jnp.exp(logits - new_max[:, None]).sum(axis=-1))
    return (new_max, running_sum), None
  start = (jnp.full(labels.shape, -jnp.inf, jnp.float32), jnp.zeros(labels.shape, jnp.float32))
  (running_max, running_sum), _ = jax.lax.scan(add_block, start, (jnp.arange(num_blocks), blocks))
  label_logits = jnp.einsum("nd,nd->n", hidden, embedding[labels].astype(hidden.dtype))
  return (running_max + jnp.log(running_sum) - label_logits.astype(jnp.float32)).mean()


def next_token_loss(model: nn.Module, params, tokens: jax.Array) -> jax.Array:
  """Mean cross-entropy of predicting tokens[:, 1:] from tokens[:, :-1], in float32."""
  block_size = model.config.cross_entropy_block_size
  if block_size:
    hidden = model.apply({"params": params}, tokens, return_hidden=True)[:, :-1]
    return blockwise_cross_entropy(hidden, model.output_embedding(params), tokens[:, 1:], block_size)
  logits = model.apply({"params": params}, tokens)[:, :-1].astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def accumulated_loss_and_grads(model: nn.Module, params, tokens: jax.Array, num_microbatches: int):
  """The batch's mean loss and its gradient, summed over microbatches by a lax.scan.

  Microbatch i is rows i, i + n, i + 2n, ... so that each one is spread over
  every device of the batch axis, and peak activation memory is that of one
  microbatch. Equal-sized microbatches make the mean of means the batch mean.
  """
  loss_and_grads = jax.value_and_grad(lambda p, t: next_token_loss(model, p, t))
  if num_microbatches == 1:
    return loss_and_grads(params, tokens)
  batch, length = tokens.shape
  microbatches = tokens.reshape(batch // num_microbatches, num_microbatches, length).swapaxes(0, 1)
  microbatches = nn.with_logical_constraint(microbatches, (None, "batch", "length"))

  def add(totals, microbatch):
    loss, grads = loss_and_grads(params, microbatch)
    return jax.tree.map(jnp.add, totals, (loss, grads)), None
  zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
  totals, _ = jax.lax.scan(add, zeros, microbatches)
  return jax.tree.map(lambda total: total / num_microbatches, totals)


def make_train_step(model: nn.Module, optimizer: optax.GradientTransformation,
                    schedule: optax.Schedule, num_microbatches: int = 1
                    ) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
  def train_step(state: TrainState, batch: Batch):
    """One update; a non-finite loss or gradient leaves params and optimizer state as they were.

    The step still counts (its batch is consumed), and train/nonfinite says it
    was skipped; the loop then warns or halts per trainer.nan_policy.
    """
    loss, grads = accumulated_loss_and_grads(model, state.params, batch["tokens"], num_microbatches)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    # Microbatch 0 (rows 0, n, 2n, ...: on every device), for optimizers that probe the loss.
    hessian_tokens = batch["tokens"][::num_microbatches]
    updates, opt_state = optimizer.update(
        grads, state.opt_state, state.params,
        loss_fn=lambda params: next_token_loss(model, params, hessian_tokens))
    params = optax.apply_updates(state.params, updates)
    if_finite = lambda new, old: jnp.where(finite, new, old)
    new_state = state.replace(step=state.step + 1,
                              params=jax.tree.map(if_finite, params, state.params),
                              opt_state=jax.tree.map(if_finite, opt_state, state.opt_state))
    metrics = {
        "train/loss": loss,
        "train/grad_norm": grad_norm,
        "train/param_norm": optax.tree.norm(new_state.params),
        "train/update_norm": optax.tree.norm(updates),
        "train/learning_rate": schedule(state.step),
        "train/nonfinite": 1.0 - finite.astype(jnp.float32),
    }
    return new_state, metrics
  return train_step


def make_eval_step(model: nn.Module) -> Callable[[Any, Batch], Metrics]:
  def eval_step(params, batch: Batch):
    return {"eval/loss": next_token_loss(model, params, batch["tokens"])}
  return eval_step


@dataclasses.dataclass(frozen=True)
class ShardedSteps:
  """The train state's layout and the jitted functions that create and advance it."""
  abstract_state: TrainState  # ShapeDtypeStructs.
  state_shardings: TrainState  # NamedShardings.
  batch_sharding: jax.sharding.NamedSharding
  init: Callable[[jax.Array], TrainState]
  train_step: Callable[[TrainState, Batch], tuple[TrainState, Metrics]]
  eval_step: Callable[[Any, Batch], Metrics]
  unmatched_params: frozenset[str]  # Those no partition rule matches.

  def layout_table(self) -> str:
    return partitioning.layout_table(self.abstract_state.params, self.state_shardings.params,
                                     self.abstract_state.opt_state, self.state_shardings.opt_state,
                                     self.unmatched_params)


def build_sharded_steps(model: nn.Module, optimizer: optax.GradientTransformation,
                        schedule: optax.Schedule, partitioner: partitioning.Partitioner,
                        num_microbatches: int = 1) -> ShardedSteps:
  """Lays the state out with `partitioner` and jits init, train and eval with explicit shardings.

  Call (and trace) the functions inside partitioner.activation_context().
  """
  init = functools.partial(init_state, model, optimizer)
  abstract = jax.eval_shape(init, jax.random.key(0))
  shardings = TrainState(
      step=partitioner.replicated,
      params=partitioner.param_shardings(abstract.params),
      opt_state=partitioner.opt_state_shardings(optimizer, abstract.opt_state, abstract.params))
  batch = partitioner.batch_sharding()
  replicated = partitioner.replicated
  return ShardedSteps(
      abstract_state=abstract,
      state_shardings=shardings,
      batch_sharding=batch,
      init=jax.jit(init, out_shardings=shardings),
      train_step=jax.jit(make_train_step(model, optimizer, schedule, num_microbatches),
                         in_shardings=(shardings, batch), out_shardings=(shardings, replicated),
                         donate_argnums=(0,)),
      eval_step=jax.jit(make_eval_step(model), in_shardings=(shardings.params, batch),
                        out_shardings=replicated),
      unmatched_params=frozenset(partitioner.unmatched(abstract.params)),
  )
